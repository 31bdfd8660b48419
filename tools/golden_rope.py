#!/usr/bin/env python3
"""Golden RoPE angles at long positions, from transformers' LlamaRotaryEmbedding (fp32): cos and
sin at positions up to 2^19. megatrain's `Rope` must give the same values (tests/model_golden.rs).

Writes tests/golden/rope_long.safetensors (default rope): for case c in {hd128_theta5e5,
hd64_theta1e4}:
  {c}.positions [P] (f32, exact below 2^24), {c}.cos [P, hd/2], {c}.sin [P, hd/2]
and tests/golden/rope_scaled.safetensors (scaled rope: the `rope_parameters` of Llama 3.1 and
3.2, linear, YaRN as Qwen2.5's long-context configs set it, YaRN with mscale/mscale_all_dim and
no truncation), the same tensors per case, with the case's config.json in the metadata
`{c}.config` (megatrain parses it as a user's config.json). The attention factor of YaRN is in the
tables (transformers multiplies cos and sin by it). Run:  python3 tools/golden_rope.py
"""
import json
import os

import torch
from safetensors.torch import save_file
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

POSITIONS = [0, 1, 2, 4095, 65535, 65536, 65537, 131071, 200003, 300001, 524287]
CASES = {"hd128_theta5e5": (128, 500000.0), "hd64_theta1e4": (64, 10000.0)}
SCALED = {
    "llama3_1": (128, dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama3_2": (64, dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "linear": (128, dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "yarn_qwen": (128, dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                            original_max_position_embeddings=32768)),
    "yarn_mscale": (64, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.5, truncate=False)),
}


def tables(out, name, cfg, hd):
    """transformers' cos and sin of `cfg` at POSITIONS into `out` as `{name}.*`; the embedding."""
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([POSITIONS], dtype=torch.int64)
    x = torch.zeros(1, len(POSITIONS), hd, dtype=torch.float32)
    cos, sin = rope(x, pos)
    out[f"{name}.positions"] = torch.tensor(POSITIONS, dtype=torch.float32)
    out[f"{name}.cos"] = cos[0, :, : hd // 2].contiguous()
    out[f"{name}.sin"] = sin[0, :, : hd // 2].contiguous()
    return rope


def scaled():
    out, meta = {}, {}
    for name, (hd, params) in SCALED.items():
        config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hd * 4,
                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=32, max_position_embeddings=1 << 20, rope_parameters=dict(params))
        cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        rope = tables(out, name, cfg, hd)
        meta[f"{name}.config"] = json.dumps(config)
        meta[f"{name}.attention_scaling"] = repr(float(rope.attention_scaling))
    return out, meta


def main():
    out = {}
    for name, (hd, theta) in CASES.items():
        cfg = LlamaConfig(hidden_size=hd * 4, num_attention_heads=4, rope_theta=theta,
                          max_position_embeddings=1 << 20)
        tables(out, name, cfg, hd)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "rope_long.safetensors")
    save_file(out, path, metadata={"magic": "megatrain-golden", "version": "1", "generator": "tools/golden_rope.py",
                                   "torch": torch.__version__})
    print(f"wrote {path}")
    out, meta = scaled()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "rope_scaled.safetensors")
    save_file(out, path, metadata={"magic": "megatrain-golden", "version": "1", "generator": "tools/golden_rope.py",
                                   "torch": torch.__version__, "transformers": transformers.__version__, **meta})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
