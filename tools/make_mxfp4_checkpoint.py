#!/usr/bin/env python3
"""A tiny GPT-OSS checkpoint with its experts in MXFP4, as OpenAI released gpt-oss-20b/120b:
`*.experts.gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales` (E2M1 nibbles,
two per byte, 32 values per block sharing one E8M0 scale), `quantization_config.quant_method`
"mxfp4" in config.json; every other tensor as it is.

From a small GPT-OSS model (width 64, 4 experts of width 32: MXFP4 blocks run along the
input dimension, 32 values each) with seeded random weights writes
  tests/golden/gpt_oss_mxfp4/          the MXFP4 checkpoint
  tests/golden/gpt_oss_mxfp4/twin/     the same model with the experts dequantized by
                                       transformers' own `convert_moe_packed_tensors` (fp32)
so a loader of the first must read exactly the second. The quantiser picks each block's scale
2^ceil(log2(max|x| / 6)) and the nearest E2M1 value (ties to the even code), the value grid of
the released weights.
Run:  python3 tools/make_mxfp4_checkpoint.py
"""
import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")
OUT = os.path.join(ROOT, "gpt_oss_mxfp4")


def quantize(w):
    """w [E, in, out] (the parameter's layout) → blocks [E, out, in/32, 16] u8, scales [E, out, in/32] u8."""
    x = w.transpose(1, 2).contiguous().float()  # [E, out, in]: the rows transformers dequantizes
    e, rows, cols = x.shape
    assert cols % 32 == 0, cols
    g = x.reshape(e, rows, cols // 32, 32)
    amax = g.abs().amax(dim=-1).clamp(min=2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    mag = (scaled.abs()[..., None] - lut).abs()
    code = mag.argmin(dim=-1)  # ties: the lower (even-mantissa) code
    code = code + 8 * (scaled < 0).long()
    lo, hi = code[..., 0::2], code[..., 1::2]
    blocks = (lo | (hi << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


def main():
    cfg = AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               max_position_embeddings=256)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape))
    os.makedirs(os.path.join(OUT, "twin"), exist_ok=True)
    model.save_pretrained(os.path.join(OUT, "twin"), safe_serialization=True)
    tensors = load_file(os.path.join(OUT, "twin", "model.safetensors"))
    packed, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize(t)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            twin[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = t
            twin[name] = t
    cfg = json.load(open(os.path.join(OUT, "twin", "config.json")))
    save_file({k: v.contiguous() for k, v in twin.items()}, os.path.join(OUT, "twin", "model.safetensors"),
              metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    save_file(packed, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(OUT, "config.json"), "w"), indent=2)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
