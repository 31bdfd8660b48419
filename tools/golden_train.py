#!/usr/bin/env python3
"""Golden data for `megatrain train`, from PyTorch + transformers (fp32, eager), with megatrain's
data and loss semantics:

  rows of T+1 consecutive tokens (row r = tokens[r(T+1):(r+1)(T+1)]), no shuffle, B rows per
  micro-batch, M micro-batches per step; loss = mean over every token of the step (a mixture of
  experts with output_router_logits: plus router_aux_loss_coef × transformers' aux_loss of each
  micro-batch, averaged over the step's micro-batches); global-norm
  clipping (clip_grad_norm_) when max_norm > 0; torch.optim.AdamW, weight decay on every tensor;
  lr(t) = lr·t/warmup for t ≤ warmup, then cosine to 0 over the remaining steps.

Models are Llama unless a case names model_type (qwen3: QK-norm, with q_norm/k_norm weights
1 + 0.5·randn, and head_dim from the case; gemma3_text: Gemma 3, norm weights around 0 as its
norms apply 1 + w); a case's `config` dict adds config keys (e.g. sliding_window for
mistral_window).

For each case writes tests/golden/train_{case}/ with
  init/         the initial weights, as transformers saves them (the CLI's --init-from)
  data.bin      u16 tokens
  golden.safetensors  metadata: magic, version, settings (JSON); tensors: loss [S], grad_norm [S],
                final.{name} (weights after S steps)
Run:  python3 tools/golden_train.py [CASE ...]      (every case, or only those named)
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

MAGIC, VERSION = "megatrain-golden", "1"
BASE = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, vocab_size=61, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=128, hidden_act="silu")
CASES = {
    "mha": dict(heads=4, kv=4, tied=False, B=2, T=16, M=1, steps=4, clip=0.0, lr=3e-3, warmup=0, wd=0.1),
    "gqa": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=0.0, lr=3e-3, warmup=2, wd=0.0),
    "tied": dict(heads=4, kv=2, tied=True, B=1, T=24, M=1, steps=4, clip=0.0, lr=2e-3, warmup=0, wd=0.01),
    "clip": dict(heads=4, kv=1, tied=False, B=2, T=16, M=1, steps=4, clip=0.5, lr=3e-3, warmup=1, wd=0.1),
    "accum": dict(heads=4, kv=2, tied=True, B=2, T=12, M=3, steps=3, clip=1.0, lr=3e-3, warmup=0, wd=0.1),
    # Scaled RoPE over a pretraining context shorter than the rows, so the scaling changes them
    # (head_dim 8: wavelengths 6.3, 63, 628, 6283 positions): Llama 3.1's rule over 16 positions
    # blends the first and divides the rest by 8; YaRN over 8 blends them and scales cos/sin.
    "llama31": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                    rope=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=16)),
    "yarn": dict(heads=4, kv=2, tied=True, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.0,
                 rope=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8)),
    # Qwen3: QK-norm (per-head RMSNorm of q and k before RoPE), head_dim 12 ≠ hidden/heads = 8.
    "qwen3": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                  model_type="qwen3", head_dim=12),
    # Mistral with sliding-window attention, window 6 over rows of 20 tokens.
    "mistral_window": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                           model_type="mistral", config=dict(sliding_window=6)),
    # Gemma 3 text (see tools/golden_model.py): norms 1 + w around 0, sandwich norms, QK-norm,
    # GELU-tanh, embeddings × √32, attention scale 20^-½, a local layer (window 6 of 20, RoPE θ
    # 100) and a global one (linear RoPE ÷2), tied, padding index 0.
    "gemma3": dict(heads=4, kv=2, tied=True, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                   model_type="gemma3_text", head_dim=12,
                   config=dict(query_pre_attn_scalar=20, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                                "full_attention": dict(rope_type="linear", factor=2.0,
                                                                       rope_theta=10000.0)},
                               hidden_activation="gelu_pytorch_tanh")),
    # Gemma 2 (see tools/golden_model.py): soft caps at 0.2 (scores) and 0.5 (logits).
    "gemma2": dict(heads=4, kv=2, tied=True, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                   model_type="gemma2", head_dim=12,
                   config=dict(query_pre_attn_scalar=20, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"],
                               attn_logit_softcapping=0.2, final_logit_softcapping=0.5,
                               hidden_activation="gelu_pytorch_tanh")),
    # Ministral with a window of 6 on layer 0 only.
    "ministral_window": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0,
                             wd=0.1, model_type="ministral", head_dim=8,
                             config=dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    # Mixtral: 4 experts of width 24, top-2 renormalised, on both layers; 2 micro-batches a step.
    "mixtral": dict(heads=4, kv=2, tied=False, B=2, T=12, M=2, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                    model_type="mixtral",
                    config=dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None)),
    # Qwen3-MoE: 32 experts of width 16, top-3 not renormalised, on layers 0 and 2 (layer 1 dense);
    # 8 tokens a step reach at most 24 experts, so some get no token in every step (no gradient,
    # yet AdamW decays them and their moments).
    "qwen3_moe": dict(heads=4, kv=2, tied=False, B=1, T=8, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                      model_type="qwen3_moe", head_dim=12,
                      config=dict(num_hidden_layers=3, num_experts=32, num_experts_per_tok=3,
                                  moe_intermediate_size=16, norm_topk_prob=False, mlp_only_layers=[1],
                                  use_sliding_window=False)),
    # GPT-OSS (see tools/golden_model.py): biases, sinks (std 1), a window of 6 on layer 0, YaRN;
    # 8 experts of width 16, top-2 logits then their softmax, biased interleaved experts, the
    # SwiGLU clamped at 0.3; 2 micro-batches a step.
    "gpt_oss": dict(heads=4, kv=2, tied=False, B=2, T=12, M=2, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                    model_type="gpt_oss", head_dim=8,
                    config=dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=6, swiglu_limit=0.3)),
    # Mixtral training transformers' load-balancing loss (output_router_logits) with a weight
    # that matters (0.5: the aux term moves the router's gradient by about as much as the
    # cross-entropy's); 2 micro-batches a step, each its own aux loss.
    "mixtral_aux": dict(heads=4, kv=2, tied=False, B=2, T=12, M=2, steps=4, clip=1.0, lr=3e-3, warmup=0,
                        wd=0.1, model_type="mixtral",
                        config=dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=None, output_router_logits=True,
                                    router_aux_loss_coef=0.5)),
    # GPT-OSS likewise (its router picks by the logits; the aux loss still takes the softmax over
    # every expert), one micro-batch a step.
    "gpt_oss_aux": dict(heads=4, kv=2, tied=False, B=2, T=12, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0,
                        wd=0.1, model_type="gpt_oss", head_dim=8,
                        config=dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                    sliding_window=6, swiglu_limit=0.3, output_router_logits=True,
                                    router_aux_loss_coef=0.5)),
}
QK_NORM_SPREAD = 0.5  # std of q_norm/k_norm weights around 1 (other norm weights: 0.1)


def lr_at(c, t):
    if t <= c["warmup"]:
        return c["lr"] * t / c["warmup"]
    span = max(c["steps"] - c["warmup"], 1)
    p = min((t - c["warmup"]) / span, 1.0)
    return c["lr"] * 0.5 * (1.0 + math.cos(math.pi * p))


def run(case, c, seed, attn_implementation="eager", generator="tools/golden_train.py", settings=None,
        micro_grads=None, model_hook=None):
    """Train case `case` with settings `c` from seed `seed` and write its golden directory;
    `settings` (default `c`) is what the golden records; `micro_grads`, if given, maps each
    micro-batch's gradient before it is added to the step's (fp32) sum; `model_hook`, if given,
    is applied to the model once its initial weights are saved."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", f"train_{case}")
    os.makedirs(root, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d = dict(BASE, num_attention_heads=c["heads"], num_key_value_heads=c["kv"], tie_word_embeddings=c["tied"])
    if "rope" in c:
        d.pop("rope_theta")
        d["rope_parameters"] = dict(c["rope"])
    model_type = c.get("model_type", "llama")
    if model_type == "qwen3":
        d.update(head_dim=c["head_dim"], use_sliding_window=False, attention_bias=False)
    elif "head_dim" in c:
        d["head_dim"] = c["head_dim"]
    d.update(c.get("config", {}))  # further config.json keys (e.g. sliding_window)
    gemma = model_type.startswith("gemma")
    if gemma:
        d.pop("hidden_act")
        if "rope_parameters" in d:
            d.pop("rope_theta", None)
    cfg = AutoConfig.for_model(model_type, **d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn_implementation)
    with torch.no_grad():
        for n, p in model.named_parameters():
            # Norm weights around 1, or around 0 where the norm applies 1 + w (Gemma).
            center = 0.0 if gemma else 1.0
            if n.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(center + QK_NORM_SPREAD * torch.randn(p.shape, generator=g))
            else:
                p.copy_(center + 0.1 * torch.randn(p.shape, generator=g) if "norm" in n else 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(os.path.join(root, "init"), safe_serialization=True)
    if model_hook is not None:
        model_hook(model)
    B, T, M, S = c["B"], c["T"], c["M"], c["steps"]
    rows = B * M * S + 1
    tokens = torch.randint(0, cfg.vocab_size, (rows * (T + 1),), generator=g)
    with open(os.path.join(root, "data.bin"), "wb") as f:
        f.write(tokens.to(torch.int32).numpy().astype("<u2").tobytes())
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=c["wd"])
    losses, norms = [], []
    r = 0
    for t in range(1, S + 1):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(c, t)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(M):
            batch = torch.stack([tokens[(r + i) * (T + 1):(r + i + 1) * (T + 1)] for i in range(B)])
            r += B
            out = model(input_ids=batch[:, :T])
            logits = out.logits
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1), reduction="sum") / (B * T * M)
            if getattr(cfg, "output_router_logits", False):
                loss = loss + cfg.router_aux_loss_coef * out.aux_loss / M
            if micro_grads is None:
                loss.backward()
            else:
                summed = [p.grad for p in model.parameters()]
                for p in model.parameters():
                    p.grad = None
                loss.backward()
                for p, acc in zip(model.parameters(), summed):
                    g = micro_grads(p.grad)
                    p.grad = g if acc is None else acc + g
            total += loss.item()
        params = [p for p in model.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(params, c["clip"] if c["clip"] > 0 else float("inf"))
        losses.append(total)
        norms.append(norm.item())
        opt.step()
    out = {"loss": torch.tensor(losses, dtype=torch.float32), "grad_norm": torch.tensor(norms, dtype=torch.float32)}
    for n, p in model.named_parameters():
        out[f"final.{n}"] = p.detach().clone()
    meta = {"magic": MAGIC, "version": VERSION, "generator": generator, "torch": torch.__version__,
            "settings": json.dumps(c if settings is None else settings)}
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(root, "golden.safetensors"), metadata=meta)
    print(f"wrote {root}", file=sys.stderr)


def main():
    torch.set_num_threads(1)
    only = set(sys.argv[1:])
    for i, (case, c) in enumerate(CASES.items()):
        if not only or case in only:
            run(case, c, 300 + i)


if __name__ == "__main__":
    main()
