#!/usr/bin/env bash
# What checkpoints cost a run when they are written while training goes on: the demo with a
# checkpoint after every step (each written beside the next step) against the same demo with
# only the final one, run alternately PAIRS times in one invocation (this machine's speed drifts
# between minutes; alternating pairs sees the same drift on both sides). Prints each pair's wall
# times, the median ratio, and what the runs reported about the overlapped writes.
# Usage: tools/bench_checkpoint_overlap.sh [PAIRS] [STEPS] (default 5 pairs of 60 steps).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-5}
steps=${2:-60}
bin=target/release/megatrain
cargo build --release --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() { # every → seconds of wall time
  rm -rf "$work/run" && mkdir -p "$work/run"
  local t0 t1
  t0=$(date +%s.%N)
  "$bin" train --demo --demo-dir "$work/run" --steps "$steps" --val-every 0 \
    --checkpoint-every "$1" 2> "$work/log-$1"
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }'
}
ratios=()
for i in $(seq "$pairs"); do
  off=$(run 0)
  on=$(run 1)
  r=$(awk -v a="$on" -v b="$off" 'BEGIN { print a / b }')
  ratios+=("$r")
  printf 'pair %d: final checkpoint only %.2f s, a checkpoint every step %.2f s: %.3fx\n' \
    "$i" "$off" "$on" "$r"
done
median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
printf 'median over %d pairs of %d steps: %.3fx\n' "$pairs" "$steps" "$median"
# The last run's own report of its overlapped writes (all but the final one).
grep -E 'while training went on' "$work/log-1" | awk '
  { n++; for (i = 1; i <= NF; i++) { if ($i == "waited") w += $(i + 1); if ($(i) == "in") s += $(i + 1) } }
  END { if (n) printf "last run: %d overlapped checkpoints, %.2f s writing in all, training waited %.3f s for them\n", n, s, w }'
