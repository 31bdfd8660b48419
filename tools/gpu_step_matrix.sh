#!/usr/bin/env bash
# Where a streamed step's time goes on a GPU: the step of tools/gpu_check.sh (4 layers as wide as
# Llama-3-8B, 32k tokens per step, bf16 recipe) run in several ways that move the same tokens, one
# row each, with the per-stream times and bytes megatrain records and the GPU's utilisation.
#
#   tools/gpu_step_matrix.sh [--emulated] OUT_DIR [VARIANT...]
#
# A VARIANT is NAME:BATCH:ACCUM[:FLAG,FLAG...] (flags of `megatrain train`, commas for blanks), e.g.
# `b8a1-lean:8:1:--mode,lean`; without any, the default set below. Writes OUT_DIR/matrix.md: one
# row per variant (median over the steps after the first of tokens/s, the step's wall, Σ compute,
# Σ copy time both ways, the bytes each way, AdamW and I/O waits, the device's peak; GPU busy
# from nvidia-smi), matrix.txt (every run's output and metrics) and trace-NAME.json (each run's
# trace). The binary as tools/gpu_check.sh finds it. --emulated: small shapes under
# tools/cuemu.sh (host times, never GPU figures). MEGATRAIN_MATRIX_STEPS: steps per run (4).
# Exit status: 0 when every run succeeded.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
emulated="" out="" variants=()
for a in "$@"; do
  case "$a" in
    --emulated) emulated=1 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $a" >&2; exit 2 ;;
    *) if [ -z "$out" ]; then out="$a"; else variants+=("$a"); fi ;;
  esac
done
[ -n "$out" ] || { echo "usage: tools/gpu_step_matrix.sh [--emulated] OUT_DIR [NAME:BATCH:ACCUM[:FLAGS]...]" >&2; exit 2; }
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
[ ${#variants[@]} -gt 0 ] || variants=(
  "b1a8:1:8" "b1a8-bf16link:1:8:--grad-link,bf16" "b2a4:2:4" "b8a1:8:1" "b8a1-lean:8:1:--mode,lean")

. "$root/tools/gpu_common.sh"
megatrain_bin
run=("$bin")
[ -n "$emulated" ] && run=("$root/tools/cuemu.sh" "$bin")

scratch="$(mktemp -d "${TMPDIR:-/tmp}/megatrain-step-matrix.XXXXXX")"
sampler=""
trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null; rm -rf "$scratch"' EXIT

if [ -n "$emulated" ]; then
  seq=64 layers=2 hidden=128 ffn=256 heads=4 kv=2 vocab=65536 tokens=$((64 * 8))
else
  seq=4096 layers=4 hidden=4096 ffn=14336 heads=32 kv=8 vocab=128256 tokens=$((4096 * 8))
fi
steps="${MEGATRAIN_MATRIX_STEPS:-4}"
llama_config "$layers" "$hidden" "$ffn" "$heads" "$kv" "$vocab" > "$scratch/config.json"
rows=$(( tokens / seq * (steps + 1) + 1 ))
head -c $(( 2 * rows * (seq + 1) )) /dev/urandom > "$scratch/data.bin"

matrix="$out/matrix.md" detail="$out/matrix.txt"
{
  echo "# step matrix: $layers layers, hidden $hidden, ffn $ffn, heads $heads/$kv, vocab $vocab; $tokens tokens per step of $seq-token rows, bf16 recipe, $steps steps; $(date -u +%FT%TZ); $("$bin" --version 2>/dev/null)"
  [ -n "$emulated" ] && echo "(emulated: host times, not GPU figures)"
  echo
  echo "| variant | tokens/s | wall s | compute s | transfer s | H→D GB | D→H GB | optimizer s | io wait s | device peak GiB | GPU busy | rc |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$matrix"
: > "$detail"

# median FIELD FILE: the median of FIELD over the steps after the first.
median() {
  awk -v x="$(step_median "$1" "$2")" 'BEGIN { if (x == "") printf "n/a"; else printf "%.4g", x }'
}

failed=0
for v in "${variants[@]}"; do
  IFS=: read -r name batch accum flags <<< "$v"
  extra=()
  [ -n "${flags:-}" ] && IFS=, read -r -a extra <<< "$flags"
  trace=(--trace "$out/trace-$name.json")
  m="$scratch/$name.jsonl"
  if [ -z "$emulated" ] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 250 > "$scratch/$name.smi" 2>/dev/null &
    sampler=$!
  fi
  echo "## $name: batch $batch, grad-accum $accum ${extra[*]:-}" >> "$detail"
  timeout 150 "${run[@]}" train --model "$scratch/config.json" --data "$scratch/data.bin" \
    --seq-len "$seq" --batch-size "$batch" --grad-accum "$accum" --steps "$steps" \
    --device cuda --precision bf16 --lr 1e-4 --metrics "$m" ${trace[@]+"${trace[@]}"} \
    ${extra[@]+"${extra[@]}"} >> "$detail" 2>&1
  rc=$?
  [ $rc -eq 0 ] || failed=$((failed + 1))
  [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; sampler=""; }
  [ -f "$m" ] && cat "$m" >> "$detail"
  busy="n/a"
  [ -s "$scratch/$name.smi" ] && busy="$(awk '{ s += $1; n++ } END { if (n) printf "%.0f%%", s / n }' "$scratch/$name.smi")"
  gib() { awk -v b="$1" 'BEGIN { if (b == "n/a") print b; else printf "%.2f", b / 2^30 }'; }
  gb() { awk -v b="$1" 'BEGIN { if (b == "n/a") print b; else printf "%.1f", b / 1e9 }'; }
  echo "| $name | $(median tokens_per_s "$m") | $(median wall_s "$m") | $(median compute_s "$m") | $(median transfer_s "$m") | $(gb "$(median htod_bytes "$m")") | $(gb "$(median dtoh_bytes "$m")") | $(median optimizer_s "$m") | $(median io_wait_s "$m") | $(gib "$(median device_peak_bytes "$m")") | $busy | $rc |" >> "$matrix"
done
cat "$matrix"
[ $failed -eq 0 ]
