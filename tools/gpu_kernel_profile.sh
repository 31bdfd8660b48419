#!/usr/bin/env bash
# Where a GPU step's time goes, kernel by kernel: training steps of one of the GPU check's
# models under Nsight Compute, every kernel timed (gpu__time_duration; the clocks left as they
# are), summed by kernel name, largest first, beside the same run's step time without ncu.
#
#   tools/gpu_kernel_profile.sh OUT_DIR [moe|step] [STEPS]
#
#   moe   2 layers as wide as Qwen3-30B-A3B's (128 experts of 768, top-8), 8 × 4096 tokens,
#         the bf16 recipe (the check's moe stage)
#   step  4 layers of Llama-3-8B's width, 8 × 4096 tokens in one micro-batch, bf16
#
# Writes OUT_DIR/profile-NAME.md (the table, the kernels' sum against the step's compute time),
# OUT_DIR/profile-NAME.csv (ncu's raw per-launch rows) and OUT_DIR/trace-NAME.json (the run
# without ncu as `megatrain train --trace` records it: every stream's ops, chrome://tracing). Needs `ncu` with access to the
# hardware counters (a Firecracker VM of the lent machines has it, gVisor does not) and the
# binary as tools/gpu_check.sh finds it. The kernels are timed one at a time (ncu serialises
# them): their sum is the GPU's busy time; the step's compute time beyond it is the host's
# (launches, waits).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: tools/gpu_kernel_profile.sh OUT_DIR [moe|step] [STEPS]}" which="${2:-moe}" steps="${3:-1}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
. "$root/tools/gpu_common.sh"
megatrain_bin
command -v ncu >/dev/null || { echo "error: no ncu (Nsight Compute) on PATH" >&2; exit 2; }
dir="$(mktemp -d "${TMPDIR:-/tmp}/megatrain-profile.XXXXXX")"
trap 'rm -rf "$dir"' EXIT
profile_model "$which" "$dir" || exit 2
seq=4096
head -c $(( 2 * (batch * (steps + 4) + 1) * (seq + 1) )) /dev/urandom > "$dir/data.bin"
train() {  # STEPS METRICS [WRAPPER...]
  local n="$1" m="$2"; shift 2
  "$@" "$bin" train --model "$dir/config.json" --data "$dir/data.bin" --seq-len $seq --batch-size $batch \
    --grad-accum 1 --steps "$n" --device cuda --precision bf16 --lr 1e-4 --metrics "$m" ${MEGATRAIN_TRACE_ARGS:-}
}
t0=$(date +%s)
echo "== $which: $((steps + 2)) steps without ncu" >&2
stamp() { while IFS= read -r l; do printf '[%s] %s\n' "$(date +%T.%N | cut -c1-12)" "$l"; done; }
MEGATRAIN_TRACE_ARGS="--trace $out/trace-$which.json" train $((steps + 2)) "$dir/plain.jsonl" 2>&1 | stamp >&2 || exit 1
t1=$(date +%s)
echo "== the same under ncu ($((t1 - t0)) s without)" >&2
train "$steps" "$dir/ncu.jsonl" timeout 300 ncu --clock-control none --cache-control none \
  --metrics gpu__time_duration.sum --csv --print-units base \
  --log-file "$out/profile-$which.csv" > /dev/null 2> "$dir/ncu.err" || { tail -20 "$dir/ncu.err" >&2; exit 1; }
echo "== ncu: $(( $(date +%s) - t1 )) s" >&2
python3 - "$out/profile-$which.csv" "$dir/plain.jsonl" "$which" "$steps" > "$out/profile-$which.md" <<'EOF'
import csv, json, sys
path, metrics, which, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
rows = list(csv.DictReader(lines))
by = {}
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    unit = r.get("Metric Unit", "ns")
    v = float(r["Metric Value"].replace(",", ""))
    v *= {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0}.get(unit, 1e-9)
    name = r["Kernel Name"].split("(")[0][:90]
    n, t = by.get(name, (0, 0.0))
    by[name] = (n + 1, t + v)
total = sum(t for _, t in by.values())
# The steps without ncu after the first (start-up), as many as were profiled.
steps_m = [json.loads(l) for l in open(metrics) if l.strip()][1:][:steps]
compute = sum(m.get("compute_s", 0.0) for m in steps_m)
wall = sum(m.get("wall_s", 0.0) for m in steps_m)
print(f"# {which}: {steps} step(s), every kernel of the run timed by ncu\n")
print(f"- kernels' sum (GPU busy, run start to end): {total:.3f} s over {sum(n for n, _ in by.values())} launches")
print(f"- as many steps without ncu (after the first): compute {compute:.3f} s, wall {wall:.3f} s\n")
print("| kernel | launches | total ms | mean µs | share |")
print("|---|---|---|---|---|")
for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"| `{name}` | {n} | {t * 1e3:.1f} | {t / n * 1e6:.1f} | {t / total:.1%} |")
EOF
cat "$out/profile-$which.md"
