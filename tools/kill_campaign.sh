#!/usr/bin/env bash
# Kill -9 campaign: train a small model straight through once, then train it again while
# SIGKILLing the process at random moments (often inside a checkpoint write) and restarting it
# with `--resume auto`, until it finishes. The two final checkpoints must be identical bit for
# bit, and the directory must hold exactly the --keep-checkpoints 2 it keeps (no half-written or
# half-pruned leftovers). Prints the number of kills survived. Usage: tools/kill_campaign.sh
# [KILLS] (default 50).
set -euo pipefail
cd "$(dirname "$0")/.."
kills=${1:-50}
bin=target/release/megatrain
cargo build --release --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/model.json" <<'EOF'
{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":160,"num_hidden_layers":3,
 "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":256,"tie_word_embeddings":true}
EOF
python3 - "$work/train.bin" <<'EOF'
import random, struct, sys
random.seed(7)
open(sys.argv[1], "wb").write(b"".join(struct.pack("<H", random.randrange(256)) for _ in range(200000)))
EOF
steps=$((kills * 40 + 40))
args=(train --model "$work/model.json" --data "$work/train.bin" --seq-len 32 --batch-size 4
      --steps "$steps" --checkpoint-every 1 --keep-checkpoints 2 --shuffle --seed 3)
"$bin" "${args[@]}" --checkpoint-dir "$work/straight" 2>/dev/null
survived=0
while :; do
  "$bin" "${args[@]}" --checkpoint-dir "$work/killed" --resume auto 2>/dev/null &
  pid=$!
  if [ "$survived" -lt "$kills" ]; then
    sleep "0.$((RANDOM % 40 + 5))"
    if kill -9 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null || true
      survived=$((survived + 1))
      continue
    fi
  fi
  wait "$pid"
  break
done
last=$(printf 'step-%08d' "$steps")
for f in params.f32 adam_m.f32 adam_v.f32; do
  cmp "$work/straight/$last/$f" "$work/killed/$last/$f"
done
# Pruning renames a checkpoint away before deleting it, and a run removes what dead writers
# left: exactly the kept checkpoints remain, however many kills landed mid-prune.
kept=$(find "$work/killed" -mindepth 1 -maxdepth 1 -name 'step-*' | wc -l)
leftovers=$(find "$work/killed" -mindepth 1 -maxdepth 1 ! -name 'step-*' ! -name .megatrain.lock | wc -l)
if [ "$kept" -ne 2 ] || [ "$leftovers" -ne 0 ]; then
  echo "kill -9 campaign: $kept checkpoints and $leftovers other entries left (want 2 and 0):" >&2
  ls -la "$work/killed" >&2
  exit 1
fi
echo "kill -9 campaign: $survived kills survived, final state bit-identical to the straight run ($steps steps); exactly the 2 kept checkpoints left, no leftovers"
