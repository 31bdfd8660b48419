#!/usr/bin/env bash
# Long context on the CPU device: a 2-layer model (hidden 128, MLP 352) trained at T = 16,384
# twice, with the whole micro-batch's layer workspace and with --device-memory 64MiB (the
# layers then run in token chunks), and the two runs' per-step losses and gradient norms
# compared: they must be the same bits.
#
# usage: tools/long_context_cpu.sh [WORK_DIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/megatrain-long-context}
steps=${2:-2}
t=16384
mkdir -p "$work"
cargo build --release --quiet
bin=target/release/megatrain

cat > "$work/model.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
 "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16384,
 "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": true}
EOF
# Byte tokens: 4 sequences' worth of a deterministic text (u16 little endian).
python3 - "$work/train.bin" "$t" <<'EOF'
import sys
path, t = sys.argv[1], int(sys.argv[2])
text = b"".join(b"line %d: the quick brown fox jumps over the lazy dog %d times.\n" % (i, i * 7 % 13)
                for i in range(4 * t // 40 + 1))
toks = text[: 4 * t + 1]
with open(path, "wb") as f:
    for b in toks:
        f.write(bytes([b, 0]))
EOF

run() { # name device-memory
  rm -rf "$work/$1"
  /usr/bin/time -f "$1: %e s wall, %M KiB max RSS" "$bin" train --model "$work/model.json" \
    --data "$work/train.bin" --seq-len $t --batch-size 1 --steps "$steps" --lr 1e-3 \
    --mode exact --activations host --device-memory "$2" \
    --metrics "$work/$1/metrics.jsonl" --checkpoint-dir "$work/$1/ckpt" 2>&1 \
    | grep -E "token chunks|tokens/s|step +[0-9]|$1" || true
}
run whole 2GiB
run chunked 64MiB

python3 - "$work" <<'EOF'
import json, sys
w = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{w}/{name}/metrics.jsonl")]
a, b = rows("whole"), rows("chunked")
for x, y in zip(a, b):
    print(f"step {x['step']}: loss {x['loss']!r} vs {y['loss']!r}, grad norm {x['grad_norm']!r} vs "
          f"{y['grad_norm']!r}, {x['tokens_per_s']:.0f} vs {y['tokens_per_s']:.0f} tokens/s")
same = [(x["loss"], x["grad_norm"]) for x in a] == [(y["loss"], y["grad_norm"]) for y in b]
print("identical" if same else "DIFFERENT")
sys.exit(0 if same and len(a) == len(b) > 0 else 1)
EOF
