#!/usr/bin/env python3
"""Golden data for megatrain's Llama-family layers, from Hugging Face transformers (fp32, eager).

For each small config writes tests/golden/model_{case}.safetensors with metadata
  magic "megatrain-golden", version "1", config (the model's config.json as transformers writes
  it), batch, seq, adamw (hyperparameters of the optimizer steps)
and tensors (all float32; token ids are exact small integers):
  param.{hf_name}   every parameter, randomized (norm weights around 1, biases non-zero)
  tokens [B, T], targets [B, T]
  logits [B, T, V], loss [1]   (mean cross-entropy over B·T)
  grad.{hf_name}    d loss / d param
  step_loss [S]     loss at each of S AdamW steps on the same batch (torch.optim.AdamW)
  final.{hf_name}   parameters after the S steps
Cases (mha, gqa, mqa, tied, qwen2, mistral, llama31, yarn, qwen3, mistral_window, qwen2_window,
gemma3)
cover MHA, GQA, MQA, tied embeddings, Qwen2 q/k/v bias, Mistral, sequence lengths that are not a
multiple of the 64-token attention tile, scaled RoPE (Llama 3.1's llama3, YaRN), Qwen3 (per-head
RMSNorm of q and k before RoPE, "QK-norm", with q_norm/k_norm weights 1 + 0.5·randn; head_dim
12 ≠ hidden/heads), and sliding-window attention (Mistral on every layer, window 7 over 40
tokens; Qwen2 on layer 1 only, max_window_layers 1, window 5 over 50 tokens), and Gemma 3 text
(`1 + w` norms around 0, sandwich norms, GELU-tanh, scaled embeddings, query_pre_attn_scalar,
local and global layers with their own RoPE, padding index), Gemma 2 (soft-capped attention
scores and logits). Run:
  python3 tools/golden_model.py [CASE ...]      (every case, or only those named)
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

MAGIC, VERSION = "megatrain-golden", "1"
STEPS = 3
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}

BASE = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, vocab_size=97,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
            hidden_act="silu", tie_word_embeddings=False)
CASES = {
    "mha": (dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4), 2, 37),
    "gqa": (dict(model_type="llama", num_attention_heads=8, num_key_value_heads=2), 1, 70),
    "mqa": (dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0), 2, 33),
    "tied": (dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), 2, 65),
    "qwen2": (dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                   use_sliding_window=False), 1, 50),
    "mistral": (dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None), 2, 20),
    # Scaled RoPE with a pretraining context short enough that the scaling changes these positions:
    # head_dim 8 has wavelengths 6.3, 63, 628 and 6283; Llama 3.1's rule over 64 positions keeps
    # the first, blends the second and divides the last two by 8; YaRN over 32 positions blends
    # and scales cos/sin by its attention factor (1.139).
    "llama31": (dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64)), 2, 48),
    "yarn": (dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  use_sliding_window=False,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=32)), 1, 50),
    # Qwen3: per-head RMSNorm of q and k before RoPE (QK-norm), and head_dim 12 ≠ hidden/heads = 8
    # (q_proj [48, 32], o_proj [32, 48]). q_norm/k_norm weights get a wider spread (1 + 0.5·randn)
    # so that their weights, not only the normalization, move the numbers.
    "qwen3": (dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                   tie_word_embeddings=False, use_sliding_window=False, attention_bias=False), 2, 40),
    # Sliding-window attention (query i sees key j iff j ≤ i and i − j < sliding_window), with
    # windows much shorter than the sequences: Mistral's window on every layer; Qwen2's only on
    # layers ≥ max_window_layers (layer_types ["full_attention", "sliding_attention"]).
    "mistral_window": (dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=7), 2, 40),
    "qwen2_window": (dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          use_sliding_window=True, sliding_window=5, max_window_layers=1), 1, 50),
    # Gemma 3 text, every feature moving the numbers: `1 + w` norms (weights around 0), four per
    # block, QK-norm, GELU-tanh, embeddings × √32, attention scale 20^-½ (head_dim 12), a local
    # layer (window 7 over 40 tokens, its own RoPE θ 100) before a global one (linear RoPE ÷2),
    # tied head, padding index 0 (its row gets no gradient from the lookup).
    "gemma3": (dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    tie_word_embeddings=True, query_pre_attn_scalar=20, sliding_window=7,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                     "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=10000.0)},
                    hidden_activation="gelu_pytorch_tanh"), 2, 40),
    # Gemma 2: Gemma 3's block without QK-norm and with one RoPE, attention scores and logits
    # soft-capped — at 0.2 and 0.5, where these small scores and logits bend (the released 50 and
    # 30 would barely touch them).
    "gemma2": (dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                    tie_word_embeddings=True, query_pre_attn_scalar=20, sliding_window=7,
                    layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=0.2,
                    final_logit_softcapping=0.5, hidden_activation="gelu_pytorch_tanh"), 2, 40),
    # Ministral: Mistral with the window on the layers `layer_types` names (layer 0 here).
    "ministral_window": (dict(model_type="ministral", num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=7,
                              layer_types=["sliding_attention", "full_attention"]), 2, 40),
    # Mixtral: a mixture of 4 experts of width 24 on every layer, top-2 renormalised; every
    # expert gets tokens.
    "mixtral": (dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=None), 2, 20),
    # Qwen3-MoE: QK-norm attention; 32 experts of width 16, top-3 not renormalised, on layers 0
    # and 2 (layer 1 dense, `mlp_only_layers`); 9 tokens choose at most 27 experts, so some
    # experts get no token (no gradient, AdamW still decays them).
    "qwen3_moe": (dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                       num_hidden_layers=3, num_experts=32, num_experts_per_tok=3, moe_intermediate_size=16,
                       norm_topk_prob=False, mlp_only_layers=[1], use_sliding_window=False), 1, 9),
    # GPT-OSS: q/k/v/o biases, attention sinks (std 1, so they take a real share of the
    # softmax), a window of 7 on layer 0 and full attention on layer 1, YaRN ×32; 8 experts of
    # width 16, a biased router (top-2 logits, then their softmax), biased transposed experts with
    # gate and up interleaved, and a SwiGLU clamped at 0.3 (where these small activations bend).
    "gpt_oss": (dict(model_type="gpt_oss", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=7,
                     swiglu_limit=0.3), 2, 20),
}
QK_NORM_SPREAD = 0.5  # std of q_norm/k_norm weights around 1 (other norm weights: 0.1)


def make(case, over, b, t, seed):
    g = torch.Generator().manual_seed(seed)
    d = dict(BASE)
    d.update(over)
    if "rope_parameters" in d:
        d.pop("rope_theta")
    model_type = d.pop("model_type")
    gemma = model_type.startswith("gemma")
    if gemma:
        d.pop("hidden_act")
    cfg = AutoConfig.for_model(model_type, **d)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.eval()  # no dropout (there is none in these models anyway)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights around 1, or around 0 where the norm applies 1 + w (Gemma).
            center = 0.0 if gemma else 1.0
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(center + QK_NORM_SPREAD * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(center + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    out = {}
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        out[f"param.{n}"] = p.detach().clone()
    v = cfg.vocab_size
    tokens = torch.randint(0, v, (b, t + 1), generator=g)
    if gemma:
        tokens[0, 5] = cfg.pad_token_id  # the padding index among the inputs: its row gets no lookup gradient
    inp, tgt = tokens[:, :t], tokens[:, 1:]
    out["tokens"], out["targets"] = inp.float(), tgt.float()
    logits = model(input_ids=inp).logits
    loss = F.cross_entropy(logits.float().reshape(-1, v), tgt.reshape(-1))
    loss.backward()
    out["logits"], out["loss"] = logits.detach().clone(), loss.detach().reshape(1).clone()
    for n, p in model.named_parameters():
        out[f"grad.{n}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]),
                            eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        l = F.cross_entropy(model(input_ids=inp).logits.float().reshape(-1, v), tgt.reshape(-1))
        l.backward()
        opt.step()
        losses.append(l.item())
    out["step_loss"] = torch.tensor(losses, dtype=torch.float32)
    for n, p in model.named_parameters():
        out[f"final.{n}"] = p.detach().clone()
    meta = {"magic": MAGIC, "version": VERSION, "generator": "tools/golden_model.py",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "config": model.config.to_json_string(), "batch": str(b), "seq": str(t),
            "adamw": json.dumps(ADAMW), "params": json.dumps(names)}
    if case == "gqa":
        # A real sharded HF checkpoint of the initial weights (restored from `out`), for the
        # safetensors import tests.
        hf_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "hf_gqa")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(out[f"param.{n}"])
        model.save_pretrained(hf_dir, max_shard_size="40KB", safe_serialization=True)
        print(f"wrote {hf_dir}", file=sys.stderr)
    return out, meta


def main():
    torch.set_num_threads(2)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")
    os.makedirs(root, exist_ok=True)
    only = set(sys.argv[1:])
    for i, (case, (over, b, t)) in enumerate(CASES.items()):
        if only and case not in only:
            continue
        out, meta = make(case, over, b, t, 100 + i)
        path = os.path.join(root, f"model_{case}.safetensors")
        save_file({k: v.contiguous() for k, v in out.items()}, path, metadata=meta)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
