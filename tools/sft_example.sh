#!/usr/bin/env bash
# Chat fine-tuning end to end, on the CPU device: a tiny Hugging Face Llama and a tokenizer with a
# chat template (tools/sft_example.py), `megatrain prepare --format chat`, `megatrain train
# --init-from`, `megatrain export`, then transformers loads the export and answers a question.
#
#   tools/sft_example.sh [OUT_DIR]          (default out/sft; must not exist yet)
#
# Python with torch + transformers: $PYTHON if set, else a venv at ~/.cache/megatrain/sft-venv
# (created and filled from PyPI on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/sft}
if [ -e "$out" ]; then
    echo "error: $out exists; pass another directory (its earlier run stays as it is)" >&2
    exit 2
fi
py=${PYTHON:-}
if [ -z "$py" ]; then
    venv="$HOME/.cache/megatrain/sft-venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check torch transformers tokenizers safetensors
    py="$venv/bin/python"
fi
cargo build --release --quiet
mt=target/release/megatrain

"$py" tools/sft_example.py make "$out"
for split in chat chat_val; do
    "$mt" prepare --format chat --tokenizer "$out/model" --input "$out/$split.jsonl" --out "$out/$split.bin"
done
"$mt" train --init-from "$out/model" --data "$out/chat.bin" --val-data "$out/chat_val.bin" \
    --seq-len 256 --batch-size 4 --grad-accum 2 --steps 300 --lr 3e-3 --lr-schedule cosine \
    --warmup-steps 20 --weight-decay 0.0 --shuffle --val-every 100 --val-batches 1 \
    --checkpoint-dir "$out/ckpt" --metrics "$out/metrics.jsonl"
"$mt" export --checkpoint "$out/ckpt" --out "$out/hf"
# A question from the training data (the model is far too small to learn arithmetic).
question=$("$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["messages"][-2]["content"])' "$out/chat.jsonl")
echo "Q: $question"
echo "A: $("$py" tools/sft_example.py generate "$out/hf" "$question")"
