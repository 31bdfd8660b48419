#!/usr/bin/env python3
"""Golden RoPE angles at long positions, from transformers' LlamaRotaryEmbedding (default rope,
fp32): cos and sin at positions up to 2^19 for two (head_dim, theta) pairs. megatrain's `Rope`
must give the same values (tests/model_golden.rs).

Writes tests/golden/rope_long.safetensors: for case c in {hd128_theta5e5, hd64_theta1e4}:
  {c}.positions [P] (f32, exact below 2^24), {c}.cos [P, hd/2], {c}.sin [P, hd/2]
Run:  python3 tools/golden_rope.py
"""
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

POSITIONS = [0, 1, 2, 4095, 65535, 65536, 65537, 131071, 200003, 300001, 524287]
CASES = {"hd128_theta5e5": (128, 500000.0), "hd64_theta1e4": (64, 10000.0)}


def main():
    out = {}
    for name, (hd, theta) in CASES.items():
        cfg = LlamaConfig(hidden_size=hd * 4, num_attention_heads=4, rope_theta=theta,
                          max_position_embeddings=1 << 20)
        rope = LlamaRotaryEmbedding(cfg)
        pos = torch.tensor([POSITIONS], dtype=torch.int64)
        x = torch.zeros(1, len(POSITIONS), hd, dtype=torch.float32)
        cos, sin = rope(x, pos)
        out[f"{name}.positions"] = torch.tensor(POSITIONS, dtype=torch.float32)
        out[f"{name}.cos"] = cos[0, :, : hd // 2].contiguous()
        out[f"{name}.sin"] = sin[0, :, : hd // 2].contiguous()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "rope_long.safetensors")
    save_file(out, path, metadata={"magic": "megatrain-golden", "version": "1", "generator": "tools/golden_rope.py",
                                   "torch": torch.__version__})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
