#!/usr/bin/env bash
# Two builds on the same GPU in one run: the steps of one of tools/gpu_kernel_profile.sh's models
# (moe or step) with a baseline binary and with this one, alternating (base, new, base, new) so
# that clocks and the machine's drift weigh on both alike. Timings from different machines do not
# compare; this does.
#
#   tools/gpu_ab.sh OUT_DIR BASE_BIN [moe|step] [STEPS]
#
# The new binary is found as tools/gpu_check.sh finds it (MEGATRAIN_BIN, dist/megatrain-cuda, the
# release build). Writes OUT_DIR/ab-MODEL.md: per binary and round, the median step's wall and
# compute seconds and tokens/s (steps after the first), and OUT_DIR/ab-MODEL-{base,new}-R.jsonl
# (megatrain's per-step records).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: tools/gpu_ab.sh OUT_DIR BASE_BIN [moe|step] [STEPS]}"
base="${2:?usage: tools/gpu_ab.sh OUT_DIR BASE_BIN [moe|step] [STEPS]}" which="${3:-moe}" steps="${4:-4}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
. "$root/tools/gpu_common.sh"
megatrain_bin
new="$bin"
[ -x "$base" ] || { echo "error: $base: no such binary" >&2; exit 2; }
basedir="$(cd "$(dirname "$base")" && pwd)"
dir="$(mktemp -d "${TMPDIR:-/tmp}/megatrain-ab.XXXXXX")"
trap 'rm -rf "$dir"' EXIT
profile_model "$which" "$dir" || exit 2
seq=4096
head -c $(( 2 * (batch * steps + 1) * (seq + 1) )) /dev/urandom > "$dir/data.bin"
for round in 1 2; do
  for side in base new; do
    b="$new" libs="$bindir/lib"
    [ "$side" = base ] && { b="$base"; libs="$basedir/lib"; }
    echo "== $which round $round: $side ($b)" >&2
    LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$b" train --model "$dir/config.json" \
      --data "$dir/data.bin" --seq-len $seq --batch-size "$batch" --grad-accum 1 --steps "$steps" \
      --device cuda --precision bf16 --lr 1e-4 --metrics "$out/ab-$which-$side-$round.jsonl" \
      > "$dir/log" 2>&1 || { tail -20 "$dir/log" >&2; exit 1; }
  done
done
python3 - "$out" "$which" "$((batch * seq))" > "$out/ab-$which.md" <<'PY'
import json, statistics, sys
out, which, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
print(f"# {which}: base against new, {tokens} tokens a step (median of the steps after the first)\n")
print("| binary | round | wall s | compute s | tokens/s |")
print("|---|---|---|---|---|")
for side in ("base", "new"):
    for rnd in (1, 2):
        rows = [json.loads(l) for l in open(f"{out}/ab-{which}-{side}-{rnd}.jsonl") if l.strip()][1:]
        wall = statistics.median(r.get("wall_s", 0.0) for r in rows)
        comp = statistics.median(r.get("compute_s", 0.0) for r in rows)
        print(f"| {side} | {rnd} | {wall:.3f} | {comp:.3f} | {tokens / wall:,.0f} |")
PY
cat "$out/ab-$which.md"
