#!/usr/bin/env bash
# Data parallelism on the CUDA device, through the real CLI under mpirun: N ranks of one
# micro-batch each against one process accumulating N micro-batches of the same rows — the
# losses, the gradient norms and the final checkpoint (weights and both Adam moments) must be
# the same bits — in fp32 and in the bf16 recipe, and a second run of 2 ranks must repeat them;
# and N ranks holding 1/N of the params and Adam state each (--zero-stage 3: every rank gathers
# a unit's params from its owner before each copy to its GPU) against the same process, through
# host memory and (--param-gather nccl, where there is a GPU per rank) GPU to GPU over NCCL;
# and N ranks started by torchrun (MEGATRAIN_TORCHRUN or the PATH's), which meet at its store
# and exchange through NCCL, against the same process.
#
#   tools/gpu_dp_check.sh [--emulated] OUT_DIR
#
# The binary: MEGATRAIN_BIN, built with the features cuda and mpi, else the bundle of
# `tools/build_gpu_bundle.sh --mpi` (dist/megatrain-cuda-mpi); mpirun from the PATH (Open MPI 4/5 or MPICH, the one the
# binary links). On a server with one GPU the ranks share it, each taking its share of the
# memory; with several, local rank i takes GPU i. N is 2 and 3 (2 alone with --emulated, where
# every rank runs under the CUDA emulator, tools/cuemu.sh, on a tiny model: what the test suite
# runs, so the script never rots; its times are host times).
# Writes OUT_DIR/summary.md (one row per comparison) and OUT_DIR/dp.log (every command and what
# it wrote). Exit status: 0 when every comparison holds.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
emulated="" out=""
for a in "$@"; do
  case "$a" in
    --emulated) emulated=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $a (usage: tools/gpu_dp_check.sh [--emulated] OUT_DIR)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "error: one OUT_DIR" >&2; exit 2; }; out="$a" ;;
  esac
done
[ -n "$out" ] || { echo "usage: tools/gpu_dp_check.sh [--emulated] OUT_DIR" >&2; exit 2; }
. "$root/tools/gpu_common.sh"
# The binary and its bundled libraries (megatrain_bin); the bundle of `--mpi` when none is named.
: "${MEGATRAIN_BIN:=$root/dist/megatrain-cuda-mpi/megatrain}"
[ -x "$MEGATRAIN_BIN" ] || {
  echo "error: no binary at $MEGATRAIN_BIN (build one with features cuda and mpi: tools/build_gpu_bundle.sh --mpi; or set MEGATRAIN_BIN)" >&2; exit 2; }
megatrain_bin
command -v mpirun >/dev/null || { echo "error: no mpirun on the PATH (install Open MPI or MPICH)" >&2; exit 2; }
# torchrun (PyTorch's), for the rows of ranks it starts: MEGATRAIN_TORCHRUN, else the PATH's.
torchrun="${MEGATRAIN_TORCHRUN:-$(command -v torchrun || true)}"
command -v python3 >/dev/null || { echo "error: no python3 (it writes the tokens and compares the checkpoints)" >&2; exit 2; }
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
log="$out/dp.log" summary="$out/summary.md"
rm -f "$log" "$summary"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/megatrain-dp-check.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

mt=("$bin") ranks_n=(2 3)
if [ -n "$emulated" ]; then
  # The emulator and the CUDA wheels once, before the ranks start (each rank then finds them).
  eval "$(bash "$root/tools/setup-cuda-wheels.sh")" || exit 2
  "$root/tools/cuemu.sh" true >> "$log" 2>&1 || { echo "error: the CUDA emulator did not build (see $log)" >&2; exit 2; }
  export CUEMU_SKIP_BUILD=1
  mt=("$root/tools/cuemu.sh" "$bin") ranks_n=(2)
  # layers hidden ffn heads kv vocab seq batch steps
  shape=(2 64 128 2 1 512 16 2 4)
else
  shape=(4 1024 2816 16 4 32000 512 4 4)
fi
read -r layers hidden ffn heads kv vocab seq batch steps <<< "${shape[*]}"
llama_config "$layers" "$hidden" "$ffn" "$heads" "$kv" "$vocab" > "$scratch/config.json"
# u16 tokens: a learnable pattern (steps of 3), one in 8 random; enough rows for 3 ranks.
python3 - "$scratch/data.bin" "$vocab" $(( 3 * batch * (steps + 1) * (seq + 1) )) <<'EOF'
import random, struct, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(12345)
toks = [rng.randrange(vocab) if i % 8 == 7 else (3 * i) % vocab for i in range(n)]
open(path, "wb").write(struct.pack(f"<{n}H", *toks))
EOF

rows=()
write_summary() {
  {
    echo "# megatrain data-parallel check (CUDA device)"
    echo
    echo "- date: $(date -u +%Y-%m-%d\ %H:%M:%SZ); host: $(hostname); binary: $bin; $(mpirun --version 2>&1 | head -1)"
    if [ -n "$emulated" ]; then
      echo "- **emulated** (tools/cuemu.sh): every time is a host time, not a GPU figure"
    elif command -v nvidia-smi >/dev/null 2>&1; then
      echo "- GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd, -)"
    fi
    echo "- model: Llama-like, $layers layers of width $hidden (ffn $ffn, $heads heads, $kv KV heads), vocabulary $vocab; micro-batch $batch × $seq tokens; $steps steps, exact mode, clipping at 0.5"
    echo
    echo "| comparison | result | detail | seconds |"
    echo "|---|---|---|---|"
    printf '%s\n' ${rows[@]+"${rows[@]}"}
  } > "$summary"
}
failed=0
row() {  # WHAT RESULT DETAIL SECONDS
  rows+=("| $1 | $2 | $3 | $4 |")
  [ "$2" = FAIL ] && failed=$((failed + 1))
  write_summary
  echo "$1: $2 — $3 (${4}s)" >&2
}

# train DIR PRECISION ACCUM [mpirun -np N]: a run writing metrics and checkpoints into DIR (with
# the flags in `extra`).
extra=()
train() {
  local dir="$1" precision="$2" accum="$3"; shift 3
  local launch=("$@")
  mkdir -p "$dir"
  echo "\$ ${launch[*]} megatrain train … --precision $precision --grad-accum $accum ($dir)" >> "$log"
  timeout --kill-after=10 600 ${launch[@]+"${launch[@]}"} "${mt[@]}" train \
    --model "$scratch/config.json" --data "$scratch/data.bin" --seq-len "$seq" \
    --batch-size "$batch" --grad-accum "$accum" --steps "$steps" --device cuda \
    --precision "$precision" --lr 3e-3 --lr-schedule cosine --warmup-steps 2 --grad-clip 0.5 \
    --shuffle --seed 7 --mode exact --checkpoint-every "$steps" \
    --checkpoint-dir "$dir/ckpt" --metrics "$dir/metrics.jsonl" ${extra[@]+"${extra[@]}"} >> "$log" 2>&1
}
ranks() { echo mpirun --allow-run-as-root --oversubscribe -np "$1"; }

# same A B: "same bits" (rc 0), else what differs and by how much (rc 1).
same() {
  python3 - "$1" "$2" <<'EOF'
import array, json, os, sys
a, b = sys.argv[1], sys.argv[2]
def metrics(d):
    return [(m["step"], m["loss"], m["grad_norm"]) for m in map(json.loads, open(os.path.join(d, "metrics.jsonl")))]
def newest(d):
    c = os.path.join(d, "ckpt")
    return os.path.join(c, max(x for x in os.listdir(c) if x.startswith("step-")))
def floats(p):
    x = array.array("f"); x.frombytes(open(p, "rb").read()); return x
diff = []
ma, mb = metrics(a), metrics(b)
if len(ma) != len(mb):
    diff.append(f"{len(ma)} vs {len(mb)} steps")
for (s, la, na), (_, lb, nb) in zip(ma, mb):
    if la != lb: diff.append(f"loss at step {s}: {la!r} vs {lb!r} ({abs(la - lb) / max(abs(la), 1e-30):.1e})")
    if na != nb: diff.append(f"norm at step {s}: {na!r} vs {nb!r} ({abs(na - nb) / max(abs(na), 1e-30):.1e})")
for f in ("params.f32", "adam_m.f32", "adam_v.f32"):
    x, y = floats(os.path.join(newest(a), f)), floats(os.path.join(newest(b), f))
    if x.tobytes() != y.tobytes():
        scale = max(map(abs, x)) or 1e-30
        worst = max(abs(p - q) for p, q in zip(x, y)) / scale if len(x) == len(y) else float("inf")
        diff.append(f"{f}: {sum(p != q for p, q in zip(x, y))} of {len(x)} differ, worst {worst:.1e} of the largest")
if diff:
    print("; ".join(diff[:4])); sys.exit(1)
print(f"same bits: {len(ma)} losses and norms, {newest(a).rsplit('/', 1)[1]} (params, adam_m, adam_v); last loss {ma[-1][1]:.6f}")
EOF
}

# link_bytes NCCL_DIR HOST_DIR: rank 0's bytes across its link per step with the params gathered
# over NCCL (its own units only, the rest broadcast GPU to GPU) against through host memory
# (every unit): rc 1 unless fewer, with broadcasts.
link_bytes() {
  python3 - "$1" "$2" <<'EOF'
import json, os, sys
def last(d, k):
    return [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))][-1].get(k, 0)
nccl, host, bcast = last(sys.argv[1], "htod_bytes"), last(sys.argv[2], "htod_bytes"), last(sys.argv[1], "broadcast_bytes")
print(f"rank 0 copies {nccl / 1024:.0f} KiB a step across its link (its own units; every unit broadcast GPU to GPU: {bcast / 1024:.0f} KiB) vs {host / 1024:.0f} KiB through host memory")
sys.exit(0 if 0 < nccl < host and bcast > 0 else 1)
EOF
}

tps() {  # DIR: the median tokens/s of the steps after the first
  awk -v x="$(step_median tokens_per_s "$1/metrics.jsonl")" 'BEGIN { if (x == "") print "n/a"; else printf "%.0f", x }'
}

write_summary
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
for precision in fp32 bf16; do
  for n in "${ranks_n[@]}"; do
    t0=$(date +%s)
    r="$scratch/$precision-ranks$n" a="$scratch/$precision-accum$n"
    if ! train "$r" "$precision" 1 $(ranks "$n"); then
      row "$precision: $n ranks vs 1 process accumulating $n" FAIL "mpirun -np $n failed: $(grep -m1 'error' "$log" | cut -c1-200)" $(( $(date +%s) - t0 ))
      continue
    fi
    if ! train "$a" "$precision" "$n"; then
      row "$precision: $n ranks vs 1 process accumulating $n" FAIL "one process failed (see dp.log)" $(( $(date +%s) - t0 ))
      continue
    fi
    if said="$(same "$r" "$a" 2>&1)"; then res=PASS; else res=FAIL; fi
    row "$precision: $n ranks vs 1 process accumulating $n" $res "$said; tokens/s (job) $(tps "$r") vs $(tps "$a")" $(( $(date +%s) - t0 ))
    # torchrun's ranks: no MPI; they meet at its store and exchange through NCCL (with the
    # params sharded, gathered through the same communicator).
    for stage in 0 3; do
      t0=$(date +%s) said=""
      what="$precision: $n ranks started by torchrun (its store, NCCL between the GPUs) vs 1 process accumulating $n"
      [ "$stage" = 3 ] && what="$precision: $n ranks started by torchrun with sharded params (--zero-stage 3) vs 1 process accumulating $n"
      if [ -z "$torchrun" ]; then
        row "$what" SKIP "no torchrun (set MEGATRAIN_TORCHRUN, or put PyTorch's torchrun on the PATH: tools/setup-torchrun.sh)" 0
      elif [ -z "$emulated" ] && [ "$gpus" -lt "$n" ]; then
        row "$what" SKIP "$gpus GPU(s) for $n ranks: NCCL needs a GPU per rank" 0
      else
        tr="$scratch/$precision-torchrun$n-zero$stage"
        extra=(--zero-stage "$stage")
        if train "$tr" "$precision" 1 "$torchrun" --standalone --no-python --nproc-per-node "$n" \
           && said="$(same "$tr" "$a" 2>&1)"; then res=PASS; else res=FAIL; fi
        extra=()
        row "$what" $res "${said:-torchrun failed (see dp.log)}; tokens/s (job) $(tps "$tr")" $(( $(date +%s) - t0 ))
        said=""
      fi
    done
    t0=$(date +%s)
    z="$scratch/$precision-zero3-ranks$n"
    extra=(--zero-stage 3)
    if train "$z" "$precision" 1 $(ranks "$n") && said="$(same "$z" "$a" 2>&1)"; then res=PASS; else res=FAIL; fi
    extra=()
    row "$precision: $n ranks with sharded params (--zero-stage 3) vs 1 process accumulating $n" $res "${said:-mpirun failed (see dp.log)}; tokens/s (job) $(tps "$z")" $(( $(date +%s) - t0 ))
    said=""
    # The params gathered GPU to GPU: each unit's owner copies it in, NCCL broadcasts it. NCCL
    # needs a GPU per rank (the emulator's NCCL runs the ranks of one emulated GPU).
    t0=$(date +%s)
    what="$precision: $n ranks with params gathered over NCCL (--zero-stage 3 --param-gather nccl) vs 1 process accumulating $n"
    if [ -n "$emulated" ] || [ "$gpus" -ge "$n" ]; then
      zn="$scratch/$precision-zero3-nccl-ranks$n"
      extra=(--zero-stage 3 --param-gather nccl)
      if train "$zn" "$precision" 1 $(ranks "$n") && said="$(same "$zn" "$a" 2>&1)" \
         && link="$(link_bytes "$zn" "$z" 2>&1)"; then res=PASS; else res=FAIL; fi
      extra=()
      row "$what" $res "${said:-mpirun failed (see dp.log)}; ${link:-}; tokens/s (job) $(tps "$zn")" $(( $(date +%s) - t0 ))
      link=""
      said=""
    else
      row "$what" SKIP "$gpus GPU(s) for $n ranks: NCCL needs a GPU per rank" 0
    fi
  done
  t0=$(date +%s)
  again="$scratch/$precision-ranks2-again"
  if train "$again" "$precision" 1 $(ranks 2) && said="$(same "$again" "$scratch/$precision-ranks2" 2>&1)"; then res=PASS; else res=FAIL; fi
  row "$precision: 2 ranks, run twice" $res "${said:-mpirun failed (see dp.log)}" $(( $(date +%s) - t0 ))
  said=""
done
grep -h "GPU .* of this host\|shared by" "$log" | sort -u | head -3 | sed 's/^/  /' >> "$summary"
echo "failed comparisons: $failed" >&2
[ "$failed" -eq 0 ]
