#!/usr/bin/env python3
"""Check that transformers loads a megatrain HF export unchanged and computes the same logits
as the golden it came from.

  MEGATRAIN_KEEP_EXPORT=/tmp/mt-export cargo test --test hf_io export_then_import
  python3 tools/check_hf_export.py /tmp/mt-export tests/golden/model_gqa.safetensors
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    export, golden = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager")
    g = load_file(golden)
    tokens = g["tokens"].long()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    err = ((logits - g["logits"]).abs().max() / g["logits"].abs().max()).item()
    print(f"{type(model).__name__} loaded from {export}; logits max rel err vs golden {err:.3e}")
    sys.exit(0 if err < 1e-5 else 1)


if __name__ == "__main__":
    main()
