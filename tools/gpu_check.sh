#!/usr/bin/env bash
# One command that proves (or disproves) megatrain's CUDA path on a GPU server, and brings the
# evidence back: at most 8 files in OUT_DIR, summary.md first.
#
#   tools/gpu_check.sh [--emulated] [--big] OUT_DIR
#
# The binary: MEGATRAIN_BIN, else dist/megatrain-cuda/megatrain (tools/build_gpu_bundle.sh: the
# stripped CUDA build with the libraries it needs in lib/ beside it), else target/release/megatrain.
# Needs no network, no toolkit and no Python: CUDA 12 or 13 comes from the server (driver, and
# NVRTC + cuBLAS from the toolkit, the loader's path or NVIDIA's pip wheels — PyTorch's venv has
# them; MEGATRAIN_CUDA_VENV names one). Runs within 9 minutes on an H100/H200 server (--big adds
# about 4). Stages run in order of value; each writes its row of summary.md as it ends, so a run
# cut short still reports:
#   stack     the driver, NVRTC, headers and cuBLAS found, the kernels compiled and loaded (env.txt)
#   selftest  every kernel and GEMM against the CPU reference, training steps against the CPU
#             device, device→host landings bit for bit, the link (selftest.txt)
#   goldens   the training goldens against PyTorch + transformers, fp32 and bf16, at the test
#             suite's tolerances, one case twice for the same bits, and the generation goldens
#             (greedy tokens equal to transformers' generate) (goldens.txt)
#   bench     bench kernels, bench link, bench adam (bench.json, an array of their reports): the
#             kernels' efficiencies and the link and AdamW rates calibrate the next stage's plan —
#             and any later plan: `megatrain plan --calibration OUT_DIR/bench.json`
#   nccl      NCCL found, joined and every collective checked on this GPU (one rank: its rates
#             need a GPU per rank, `mpirun -np N megatrain bench collective --device cuda`);
#             SKIP where the machine has no NCCL
#   step      a few steps of a model as wide as Llama-3-8B (4 layers, bf16 recipe): tokens/s,
#             TFLOP/s and GPU memory (sampled from nvidia-smi) beside what `megatrain plan`
#             predicts (step.txt)
#   moe       the same for 2 mixture-of-experts layers as wide as Qwen3-30B-A3B's (128 experts,
#             top-8; the bf16 recipe), appended to step.txt
#   big       --big only: 12 layers of Llama-3-8B for a few minutes, beside the plan (step.txt)
# run.log has every command and its stderr. --emulated runs the same stages under the CUDA
# emulator (tools/cuemu.sh; CUEMU_CUDA=13 for a CUDA 13 stack) on small shapes: what CI runs, so
# the script never rots. Its figures are host times, labelled emulated: never GPU figures.
# Exit status: 0 when no stage failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
emulated="" big="" out=""
for a in "$@"; do
  case "$a" in
    --emulated) emulated=1 ;;
    --big) big=1 ;;
    -h|--help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $a (usage: tools/gpu_check.sh [--emulated] [--big] OUT_DIR)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "error: one OUT_DIR" >&2; exit 2; }; out="$a" ;;
  esac
done
[ -n "$out" ] || { echo "usage: tools/gpu_check.sh [--emulated] [--big] OUT_DIR" >&2; exit 2; }
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"

. "$root/tools/gpu_common.sh"
megatrain_bin

summary="$out/summary.md" log="$out/run.log"
for f in summary.md env.txt selftest.txt goldens.txt bench.json step.txt run.log; do rm -f "$out/$f"; done
scratch="$(mktemp -d "${TMPDIR:-/tmp}/megatrain-gpu-check.XXXXXX")"
sampler=""
cleanup() { [ -n "$sampler" ] && kill "$sampler" 2>/dev/null; rm -rf "$scratch"; }
trap cleanup EXIT
t_start=$(date +%s)

# megatrain on the GPU, or through the emulator.
if [ -n "$emulated" ]; then mt=("$root/tools/cuemu.sh" "$bin"); else mt=("$bin"); fi
# Run megatrain ARGS with a time limit; stdout to FILE, stderr to run.log. `--host` first: a
# command that needs no GPU (bench adam), run directly.
stage_run() {  # LIMIT_S FILE [--host] ARGS...
  local limit="$1" file="$2"; shift 2
  local cmd=("${mt[@]}")
  [ "${1:-}" = --host ] && { cmd=("$bin"); shift; }
  echo "\$ megatrain $*" >> "$log"
  timeout --kill-after=10 "$limit" "${cmd[@]}" "$@" >> "$file" 2>> "$log"
}
# `"key": number` from a JSON file: the Nth (1-based) occurrence.
jnum() {  # FILE KEY [N]
  grep -o "\"$2\": *[-0-9.eE+]*" "$1" 2>/dev/null | sed -n "${3:-1}p" | sed 's/.*: *//'
}
fmt() { awk -v x="$1" -v f="$2" 'BEGIN { if (x == "") print "n/a"; else printf f, x }'; }
gib() { awk -v x="$1" 'BEGIN { if (x == "") print "n/a"; else printf "%.2f GiB", x / 1073741824 }'; }

gpu_name="n/a" driver="n/a"
if [ -z "$emulated" ] && command -v nvidia-smi >/dev/null 2>&1; then
  gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi
commit="$(git -C "$root" rev-parse --short HEAD 2>/dev/null || true)"
[ -f "$bindir/VERSION" ] && commit="$(awk '/^commit/ {print substr($2,1,9) ($3 ? " " $3 " " $4 " " $5 : "")}' "$bindir/VERSION")"
rows=()
write_summary() {
  {
    echo "# megatrain GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%d\ %H:%M:%SZ); host: $(hostname); commit: ${commit:-unknown}; binary: $bin"
    if [ -n "$emulated" ]; then
      echo "- **emulated** (tools/cuemu.sh, CUDA ${CUEMU_CUDA:-12}): every figure is a host time, not a GPU figure"
    else
      echo "- GPU: $gpu_name; driver: $driver"
    fi
    echo
    echo "| stage | result | figure | seconds |"
    echo "|---|---|---|---|"
    printf '%s\n' ${rows[@]+"${rows[@]}"}
  } > "$summary.tmp" && mv "$summary.tmp" "$summary"
}
failed=0
row() {  # STAGE RESULT FIGURE SECONDS
  rows+=("| $1 | $2 | $3 | $4 |")
  [ "$2" = FAIL ] && failed=$((failed + 1))
  write_summary
  echo "$1: $2 — $3 (${4}s)" >&2
}
write_summary

# ---- stack -------------------------------------------------------------------------------------
t0=$(date +%s)
{
  echo "# environment"; date -u; uname -a; echo
  [ -f "$bindir/VERSION" ] && { echo "## binary ($bin)"; cat "$bindir/VERSION"; echo; }
  if [ -z "$emulated" ] && command -v nvidia-smi >/dev/null 2>&1; then
    echo "## nvidia-smi"; nvidia-smi 2>&1; echo
    echo "## nvidia-smi topo -m"; nvidia-smi topo -m 2>&1; echo
  else
    echo "## nvidia-smi: ${emulated:+not run (emulated)}${emulated:-not found}"; echo
  fi
  echo "## CPU and memory"; (lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|NUMA node)' ; free -g 2>/dev/null) ; echo
  echo "## CUDA libraries and kernels (megatrain selftest --device cuda --stack-only)"
} > "$out/env.txt"
stage_ok=""
if stage_run 240 "$out/env.txt" selftest --device cuda --stack-only; then
  nvrtc="$(grep -m1 -E '^ *NVRTC ' "$out/env.txt" | awk '{print $2}')"
  cublas="$(grep -m1 -E '^ *cuBLAS ' "$out/env.txt" | awk '{print $2}')"
  cuda="$(grep -m1 -E '^ *CUDA driver ' "$out/env.txt" | grep -o 'CUDA [0-9][0-9.]*' | head -1)"
  opened="$(grep -m1 -o 'opened in [0-9.]* s' "$out/env.txt")"
  row stack PASS "driver $cuda, NVRTC $nvrtc, cuBLAS $cublas; $opened" $(( $(date +%s) - t0 ))
  stage_ok=1
else
  why="$(grep -m1 '^error:' "$log" | cut -c1-300)"
  row stack FAIL "${why:-see run.log}" $(( $(date +%s) - t0 ))
fi
skip_rest() { for s in "$@"; do row "$s" SKIP "the CUDA stack did not open" 0; done; }

# ---- selftest ----------------------------------------------------------------------------------
if [ -n "$stage_ok" ]; then
  t0=$(date +%s)
  # Seconds on a GPU; the emulator (a debug build, beside other tests on two cores) takes minutes.
  limit=300; [ -n "$emulated" ] && limit=900
  if stage_run "$limit" "$out/selftest.txt" selftest --device cuda; then r=PASS; else r=FAIL; fi
  n_pass="$(grep -c ' pass$' "$out/selftest.txt")"; n_fail="$(grep -c ' FAIL$' "$out/selftest.txt")"
  link="$(grep -m1 -o 'host→device [0-9.]* GB/s, device→host [0-9.]* GB/s' "$out/selftest.txt")"
  row selftest $r "$n_pass checks pass, $n_fail fail; link ${link:-n/a}" $(( $(date +%s) - t0 ))

  # ---- goldens ---------------------------------------------------------------------------------
  t0=$(date +%s)
  if stage_run 300 "$out/goldens.txt" selftest --device cuda --goldens "$root/tests/golden"; then r=PASS; else r=FAIL; fi
  n_pass="$(grep -c ' pass$' "$out/goldens.txt")"; n_fail="$(grep -c ' FAIL$' "$out/goldens.txt")"
  fp32="$(grep -E '^train_[a-z0-9_]*: loss' "$out/goldens.txt" | grep -v '^train_bf16_' | awk '{print $(NF-2)}' | sort -g | tail -1)"
  bf16="$(grep -E '^train_bf16_[a-z0-9_]*: loss' "$out/goldens.txt" | awk '{print $(NF-2)}' | sort -g | tail -1)"
  same="$(grep -q 'same bits.* pass$' "$out/goldens.txt" && echo 'same bits twice' || echo 'NOT the same bits twice')"
  row goldens $r "$n_pass pass, $n_fail fail; worst step error vs PyTorch: fp32 ${fp32:-n/a}, bf16 ${bf16:-n/a}; $same" $(( $(date +%s) - t0 ))
else
  skip_rest selftest goldens
fi

# ---- steps of an 8B-wide model and of a mixture of experts, beside the plan --------------------
# llama_config and qwen3_moe_config (tools/gpu_common.sh): the step models' config.json files.
# steps_stage NAME FILE LIMIT_S STEPS SEQ BATCH ACCUM PRECISION CONFIG DESCRIPTION: train CONFIG
# on random tokens, sample GPU memory, and predict the same with the planner.
steps_stage() {
  local name="$1" file="$2" limit="$3" steps="$4" seq="$5" batch="$6" accum="$7" precision="$8" \
    config="$9" what="${10}"
  local t0; t0=$(date +%s)
  local dir="$scratch/$name"; mkdir -p "$dir"
  cp "$config" "$dir/config.json"
  local rows_n=$(( batch * accum * (steps + 1) + 1 ))
  # u16 tokens (every value < 65536 ≤ the vocabulary): random, seq_len + 1 per row.
  head -c $(( 2 * rows_n * (seq + 1) )) /dev/urandom > "$dir/data.bin"
  {
    echo "# $name: $what; micro-batch $batch × $seq tokens, $accum micro-batches per step, $steps steps, $precision"
    echo "## megatrain train"
  } >> "$file"
  if [ -z "$emulated" ] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=memory.used,utilization.gpu,power.draw --format=csv,noheader,nounits -lms 500 \
      > "$dir/smi.csv" 2>/dev/null &
    sampler=$!
  fi
  local r=PASS
  stage_run "$limit" "$file" train --model "$dir/config.json" --data "$dir/data.bin" \
    --seq-len "$seq" --batch-size "$batch" --grad-accum "$accum" --steps "$steps" \
    --device cuda --precision "$precision" --lr 1e-4 --metrics "$dir/m.jsonl" || r=FAIL
  [ -n "$sampler" ] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; sampler=""; }
  [ -f "$dir/m.jsonl" ] && { echo "## metrics (one JSON line per step)"; cat "$dir/m.jsonl"; } >> "$file"
  # The plan for the same machine and run: the probed machine, else the preset of this GPU.
  local machine="h100-512gb"
  case "$gpu_name" in *GH200*) machine="gh200-480gb" ;; *H200*) machine="h200-1.5tb" ;; esac
  # The probed machine when it sees a GPU (`probe --json` is pretty-printed: compare without
  # blanks).
  if [ -z "$emulated" ] && "$bin" probe --json > "$dir/probe.json" 2>> "$log" \
     && [[ "$(tr -d ' \n' < "$dir/probe.json")" == *'"gpus":[{'* ]]; then
    machine="$dir/probe.json"
  fi
  # Calibrated by the bench stage: link, AdamW and (on a GPU: the emulator's are host times) the
  # kernels' measured efficiencies.
  local cal=()
  for c in "$scratch"/bench-*.json; do
    [ -s "$c" ] || continue
    [ -n "$emulated" ] && [ "$(basename "$c")" = bench-kernels.json ] && continue
    cal+=(--calibration "$c")
  done
  echo "## megatrain plan (machine $machine)" >> "$file"
  "$bin" plan --model "$dir/config.json" --machine "$machine" --tokens-per-step $(( batch * seq * accum )) \
    --seq-len "$seq" --micro-batch-tokens $(( batch * seq )) --precision "$precision" ${cal[@]+"${cal[@]}"} --json \
    > "$dir/plan.json" 2>> "$log"
  cat "$dir/plan.json" >> "$file"
  # Measured: the median tokens/s of the steps after the first (start-up), the peak device bytes.
  local tps peak params ptps pdev smi util
  tps="$(step_median tokens_per_s "$dir/m.jsonl")"
  peak="$(grep -o '"device_peak_bytes": *[0-9]*' "$dir/m.jsonl" 2>/dev/null | sed 's/.*: *//' | sort -g | tail -1)"
  # 6·N with N the parameters a token meets: the active ones (a mixture of experts' chosen experts).
  params="$(jnum "$dir/plan.json" active_params)"
  ptps="$(jnum "$dir/plan.json" tokens_per_s)"
  pdev="$(jnum "$dir/plan.json" device_bytes)"
  smi="n/a" util="n/a"
  if [ -s "$dir/smi.csv" ]; then
    smi="$(awk -F', *' '$1 > m { m = $1 } END { printf "%.1f GiB", m / 1024 }' "$dir/smi.csv")"
    util="$(awk -F', *' '{ s += $2; n++ } END { if (n) printf "%.0f%%", s / n }' "$dir/smi.csv")"
    { echo "## nvidia-smi samples (memory.used MiB, utilization.gpu %, power.draw W; every 0.5 s)"; cat "$dir/smi.csv"; } >> "$file"
  fi
  local tflops ptflops
  tflops="$(awk -v t="$tps" -v p="$params" 'BEGIN { if (t != "" && p != "") print 6 * p * t / 1e12 }')"
  ptflops="$(awk -v t="$ptps" -v p="$params" 'BEGIN { if (t != "" && p != "") print 6 * p * t / 1e12 }')"
  local label=""; [ -n "$emulated" ] && label=" (emulated host times)"
  [ -n "$tps" ] || r=FAIL
  row "$name" $r "$(fmt "$tps" '%.0f') tokens/s$label, $(fmt "$tflops" '%.3g') TFLOP/s (6·N), device peak $(gib "$peak"), nvidia-smi max $smi, GPU busy $util; plan: $(fmt "$ptps" '%.0f') tokens/s, $(fmt "$ptflops" '%.3g') TFLOP/s, device $(gib "$pdev")" $(( $(date +%s) - t0 ))
}

# ---- bench (before the step: the plan then uses the measured link and AdamW rates) -------------
bench_stage() {
  local t0; t0=$(date +%s)
  local r=PASS k l a
  if [ -n "$emulated" ]; then
    k=(--tokens 64 --hidden 128 --ffn 256 --heads 2 --kv-heads 1 --head-dim 64 --seq 96 --reps 1)
    l=(--size 4M --reps 1)
    a=(--params 2M --reps 1)
  else
    k=() l=() a=()
  fi
  stage_run 240 "$scratch/bench-kernels.json" bench kernels ${k[@]+"${k[@]}"} --json || r=FAIL
  stage_run 120 "$scratch/bench-link.json" bench link ${l[@]+"${l[@]}"} --json || r=FAIL
  stage_run 180 "$scratch/bench-adam.json" --host bench adam ${a[@]+"${a[@]}"} --json || r=FAIL
  # One JSON array of the reports that came out (what `plan --calibration` reads back).
  {
    echo "["
    local sep=""
    for f in "$scratch/bench-kernels.json" "$scratch/bench-link.json" "$scratch/bench-adam.json"; do
      [ -s "$f" ] || continue
      printf '%s' "$sep"; cat "$f"; sep=","
    done
    echo "]"
  } > "$out/bench.json"
  # Figures: the best GEMM and attention TFLOP/s, the pinned link each way, fp32 AdamW GB/s.
  local gemm attn htod dtoh adam
  gemm="$(awk '/"kernel": *"gemm bf16/ { b = 1 } b && /"tflops"/ { gsub(/[^0-9.eE+-]/, "", $2); if ($2 > m) m = $2; b = 0 } END { if (m) print m }' "$scratch/bench-kernels.json" 2>/dev/null)"
  attn="$(awk '/"kernel": *".*tensor cores/ { b = 1 } b && /"tflops"/ { gsub(/[^0-9.eE+-]/, "", $2); if ($2 > m) m = $2; b = 0 } END { if (m) print m }' "$scratch/bench-kernels.json" 2>/dev/null)"
  htod="$(awk '/"direction": *"htod"/ { d = 1 } /"direction": *"dtoh"|"bidirectional"/ { d = 0 } d && /"pinned": *true/ { p = 1 } d && p && /"gbps"/ { gsub(/[^0-9.eE+-]/, "", $2); if ($2 > m) m = $2; p = 0 } END { if (m) print m }' "$scratch/bench-link.json" 2>/dev/null)"
  dtoh="$(awk '/"direction": *"dtoh"/ { d = 1 } /"direction": *"htod"|"bidirectional"/ { d = 0 } d && /"pinned": *true/ { p = 1 } d && p && /"gbps"/ { gsub(/[^0-9.eE+-]/, "", $2); if ($2 > m) m = $2; p = 0 } END { if (m) print m }' "$scratch/bench-link.json" 2>/dev/null)"
  adam="$(jnum "$scratch/bench-adam.json" gbytes_per_s 1)"
  local label=""; [ -n "$emulated" ] && label=" (emulated host times)"
  row bench $r "GEMM bf16 $(fmt "$gemm" '%.3g') TFLOP/s, attention (tensor cores) $(fmt "$attn" '%.3g') TFLOP/s, link pinned H→D $(fmt "$htod" '%.1f') / D→H $(fmt "$dtoh" '%.1f') GB/s, AdamW fp32 $(fmt "$adam" '%.1f') GB/s$label" $(( $(date +%s) - t0 ))
}

# ---- nccl: the library the data-parallel GPUs use, proven on one rank ---------------------------
nccl_stage() {
  local t0; t0=$(date +%s)
  local f="$scratch/bench-nccl.json" lib
  if stage_run 120 "$f" bench collective --device cuda --sizes 4M --reps 2 --json; then
    lib="$(grep -o '"library": *"NCCL[^"]*"' "$f" | head -1 | sed 's/^"library": *"//; s/"$//')"
    row nccl PASS "${lib:-NCCL}: joined, reduce-scatter, all-gather, all-reduce and broadcast checked on one rank (rates need a GPU per rank: mpirun -np N megatrain bench collective --device cuda)" $(( $(date +%s) - t0 ))
  elif grep -q 'libnccl.so.2.*not found' "$log"; then
    row nccl SKIP "no NCCL on this machine (pip install nvidia-nccl-cu13, or MEGATRAIN_NCCL_LIB=…/libnccl.so.2)" $(( $(date +%s) - t0 ))
  else
    row nccl FAIL "$(grep -m1 '^error' "$log" | cut -c1-200)" $(( $(date +%s) - t0 ))
  fi
}

if [ -n "$stage_ok" ]; then
  bench_stage
  nccl_stage
  if [ -n "$emulated" ]; then
    # Small shapes: the emulator runs every thread of every block on the host.
    llama_config 2 128 256 4 2 65536 > "$scratch/step.json"
    steps_stage step "$out/step.txt" 300 3 64 2 2 bf16 "$scratch/step.json" "2 layers, hidden 128, ffn 256, heads 4/2"
    qwen3_moe_config 2 128 64 8 2 4 2 32 65536 > "$scratch/moe.json"
    steps_stage moe "$out/step.txt" 300 3 64 2 1 bf16 "$scratch/moe.json" "Qwen3-MoE, 2 layers, hidden 128, 8 experts of 64, top-2"
  else
    # Llama-3-8B's width (4 layers; embedding and head in full): ~1.8 B parameters.
    llama_config 4 4096 14336 32 8 128256 > "$scratch/step.json"
    steps_stage step "$out/step.txt" 300 4 4096 1 8 bf16 "$scratch/step.json" "4 layers of Llama-3-8B's width (hidden 4096, ffn 14336, heads 32/8, vocab 128256)"
    # Qwen3-30B-A3B's width (2 layers; 128 experts, top-8; embedding and head in full): 1.87 B
    # parameters, 0.74 B active, ~30 GB of host state; the bf16 recipe (fp32 measured on
    # 2026-11-26: docs/gpu.md).
    qwen3_moe_config 2 2048 768 128 8 32 4 128 151936 > "$scratch/moe.json"
    steps_stage moe "$out/step.txt" 240 3 4096 8 1 bf16 "$scratch/moe.json" "2 layers of Qwen3-30B-A3B's width (hidden 2048, 128 experts of 768, top-8, heads 32/4, vocab 151936)"
  fi
  if [ -n "$big" ]; then
    if [ -n "$emulated" ]; then
      llama_config 4 128 256 4 2 65536 > "$scratch/big.json"
      steps_stage big "$out/step.txt" 600 4 64 2 4 bf16 "$scratch/big.json" "4 layers, hidden 128, ffn 256, heads 4/2"
    else
      # 12 layers of Llama-3-8B (~3.7 B parameters, ~59 GB of host state): a few minutes.
      llama_config 12 4096 14336 32 8 128256 > "$scratch/big.json"
      steps_stage big "$out/step.txt" 600 12 4096 1 16 bf16 "$scratch/big.json" "12 layers of Llama-3-8B's width"
    fi
  else
    row big SKIP "not asked for (--big)" 0
  fi
else
  skip_rest bench nccl step moe big
fi

total=$(( $(date +%s) - t_start ))
{
  echo
  echo "$failed stage(s) failed; $total s in all. Files: env.txt (machine, libraries), selftest.txt, goldens.txt, bench.json, step.txt (step, moe, big), run.log (every command's stderr)."
  if [ -z "$emulated" ]; then
    echo "Record this run in docs/gpu.md (date, GPU, driver, result, figures, commit); plan with its measurements: megatrain plan --calibration $out/bench.json …"
  fi
} >> "$summary"
cat "$summary"
[ "$failed" -eq 0 ]
