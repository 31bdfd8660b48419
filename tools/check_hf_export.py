#!/usr/bin/env python3
"""Check that transformers loads a megatrain HF export unchanged and computes the same logits
as the golden it came from — or, given a checkpoint directory, as transformers' own load of that
checkpoint, and generates the same greedy continuation.

  MEGATRAIN_KEEP_EXPORT=/tmp/mt-export cargo test --test hf_io export_then_import
  python3 tools/check_hf_export.py /tmp/mt-export tests/golden/model_gqa.safetensors
  MEGATRAIN_KEEP_GEMMA3_EXPORT=/tmp/g3 cargo test --test hf_io gemma3
  python3 tools/check_hf_export.py /tmp/g3 tests/golden/train_gemma3/init
"""
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def against_checkpoint(model, ref_dir):
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    vocab = model.config.vocab_size
    tokens = torch.randint(1, vocab, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=tokens).logits, ref(input_ids=tokens).logits
    err = ((a - b).abs().max() / b.abs().max()).item()
    ga = model.generate(tokens[:1, :8], max_new_tokens=12, do_sample=False)
    gb = ref.generate(tokens[:1, :8], max_new_tokens=12, do_sample=False)
    same = torch.equal(ga, gb)
    print(f"{type(model).__name__}: logits max rel err vs {ref_dir} {err:.3e}; greedy generation equal: {same}")
    sys.exit(0 if err < 1e-5 and same else 1)


def main():
    export, golden = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager")
    if os.path.isdir(golden):
        against_checkpoint(model, golden)
    g = load_file(golden)
    tokens = g["tokens"].long()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    err = ((logits - g["logits"]).abs().max() / g["logits"].abs().max()).item()
    print(f"{type(model).__name__} loaded from {export}; logits max rel err vs golden {err:.3e}")
    sys.exit(0 if err < 1e-5 else 1)


if __name__ == "__main__":
    main()
