#!/usr/bin/env python3
"""Golden data for `megatrain train --precision bf16`, from PyTorch + transformers running
megatrain's bf16 recipe (docs/precision.md) over an fp32 master:

  - every parameter is used as its bf16 rounding (nearest, ties toward the truncated value: the
    high plane of the master, what the device streams); its gradient reaches the fp32 master
    unchanged (straight through) and is fp32;
  - every linear layer (the LM head too) is a bf16 GEMM with fp32 accumulation and an fp32
    result: forward y = bf16(x)·Wᵀ; backward dx = bf16(dy)·W, dW = bf16(dy)ᵀ·bf16(x) (fp32
    sums), db = Σ dy;
  - attention takes Q and K after RoPE and V rounded to bf16 (round to nearest even, as the
    device stores them), and the gradient of its output rounded to bf16; softmax, its statistics
    and every other op (norms, SwiGLU, residual adds, cross-entropy) are fp32;
  - Qwen3's QK-norm is fp32 between the projection's fp32 output and RoPE (its weights used as
    their high plane, as every norm's), so Q and K are rounded once, after RoPE: the backward runs
    RoPE⁻¹ and the norm's backward in fp32 and rounds dq/dk to bf16 only for the projection's GEMMs;
  - Gemma 3: its norms ((1 + w)·x̂, w's high plane) fp32, the sandwich norms on the projections'
    fp32 outputs, GELU-tanh fp32, the embedding's high plane times √hidden (fp32), the padding
    index's row without lookup gradient.
  - mixtures of experts (Mixtral, Qwen3-MoE, GPT-OSS): the router and every expert's projections
    are bf16 GEMMs like any linear layer (the input rows, the activation, dY, d gate/up and
    d logits rounded; the weights' and biases' high planes; fp32 sums, results and bias
    gradients); routing, softmax, the activation, the weighted sum and the load-balancing loss
    fp32. GPT-OSS's sinks are used as their high plane inside the fp32 softmax, and the
    attention output's gradient, rounded to bf16, reaches them as it reaches Q, K and V.

  - a case with activation_dtype "bf16" (`--activation-dtype bf16`, the default under bf16 when
    the layer inputs are stored for a recompute): every decoder layer runs its forward on its
    fp32 input without keeping anything, stores that input rounded to bf16 (nearest even), and
    its backward recomputes the layer from the stored bf16 input (torch.utils.checkpoint's
    reentrant scheme with the saved input rounded).

Data, loss and optimizer semantics are tools/golden_train.py's. A case with grad_link "bf16"
(`--grad-link bf16`) rounds each micro-batch's gradients to bf16 (nearest even, as the device
does before they cross the link) and sums them in fp32 (as the host does). For each case writes
tests/golden/train_{case}/ with init/, data.bin and golden.safetensors (settings carry
"precision": "bf16").
Run:  python3 tools/golden_train_bf16.py [CASE ...]   (default: every case)
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.models.llama import modeling_llama
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_train  # noqa: E402

CASES = {
    "bf16_gqa": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=0.0, lr=3e-3, warmup=2, wd=0.0),
    "bf16_tied": dict(heads=4, kv=2, tied=True, B=1, T=24, M=1, steps=4, clip=0.0, lr=2e-3, warmup=0, wd=0.01),
    "bf16_clip": dict(heads=4, kv=1, tied=False, B=2, T=16, M=1, steps=4, clip=0.5, lr=3e-3, warmup=1, wd=0.1),
    "bf16_accum": dict(heads=4, kv=2, tied=True, B=2, T=12, M=3, steps=3, clip=1.0, lr=3e-3, warmup=0, wd=0.1),
    "bf16_grad_link": dict(heads=4, kv=2, tied=True, B=2, T=12, M=3, steps=3, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                           grad_link="bf16"),
    # tools/golden_train.py's "qwen3" (QK-norm, head_dim 12) under the bf16 recipe.
    "bf16_qwen3": dict(heads=4, kv=2, tied=False, B=2, T=20, M=1, steps=4, clip=1.0, lr=3e-3, warmup=0, wd=0.1,
                       model_type="qwen3", head_dim=12),
    # tools/golden_train.py's "gemma3" under the bf16 recipe, over rows of 24 tokens at lr 1e-3
    # (rows of 20 at 3e-3 put a value near a bf16 tie: docs/precision.md).
    "bf16_gemma3": dict(golden_train.CASES["gemma3"], T=24, lr=1e-3),
    # tools/golden_train.py's mixtures of experts under the bf16 recipe: Mixtral with its
    # load-balancing loss (2 micro-batches), Qwen3-MoE (experts without tokens), GPT-OSS (sinks,
    # biases, the clamp, a window; 2 micro-batches).
    "bf16_mixtral_aux": dict(golden_train.CASES["mixtral_aux"]),
    "bf16_qwen3_moe": dict(golden_train.CASES["qwen3_moe"]),
    # At lr 3e-3 the emulated GPU's 4th step (its different summation order through the top-2
    # of 8 logits and the clamp at 0.3) differed by 7e-3 in grad norm (the CPU device: 3e-8).
    "bf16_gpt_oss": dict(golden_train.CASES["gpt_oss"], lr=1e-3),
    # Layer inputs stored in bf16 and recomputed from (3 layers, 2 micro-batches); the trainer
    # runs it with the inputs on the host (as recorded) and on the device.
    "bf16_stored_inputs": dict(heads=4, kv=2, tied=False, B=2, T=20, M=2, steps=3, clip=1.0, lr=3e-3, warmup=0,
                               wd=0.1, config=dict(num_hidden_layers=3), activation_dtype="bf16",
                               activations="host"),
}


def rne(x):
    """fp32 → bf16 → fp32, round to nearest even (torch's and CUDA's conversion)."""
    return x.to(torch.bfloat16).to(torch.float32)


def hi_plane(x):
    """The master's high plane as fp32: nearest bf16, ties toward the truncated value."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (((b + 0x7FFF) >> 16) << 16) & 0xFFFFFFFF
    r = torch.where(r >= 2**31, r - 2**32, r).to(torch.int32)
    return r.view(torch.float32)


class Param(torch.autograd.Function):
    """A parameter as the device sees it (its high plane); the gradient passes straight through."""

    @staticmethod
    def forward(ctx, w):
        return hi_plane(w)

    @staticmethod
    def backward(ctx, g):
        return g


class Stored(torch.autograd.Function):
    """A tensor stored in bf16 (round to nearest even); the gradient passes straight through."""

    @staticmethod
    def forward(ctx, x):
        return rne(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradStored(torch.autograd.Function):
    """Identity forward; the gradient is stored in bf16 (rounded to nearest even)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return rne(g)


class Bf16Linear(torch.autograd.Function):
    """y = bf16(x)·bf16(W)ᵀ (+ b) with fp32 sums; backward as the module docstring says."""

    @staticmethod
    def forward(ctx, x, w, b):
        xr, wr = rne(x), hi_plane(w)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = b is not None
        y = xr @ wr.t()
        if b is not None:
            y = y + hi_plane(b)
        return y

    @staticmethod
    def backward(ctx, dy):
        xr, wr = ctx.saved_tensors
        dyr = rne(dy)
        dx = dyr @ wr
        dw = dyr.reshape(-1, dyr.shape[-1]).t() @ xr.reshape(-1, xr.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db


def linear_forward(self, x):
    return Bf16Linear.apply(x, self.weight, self.bias)


def functional_linear(x, w, b=None):
    """`F.linear` as the recipe's GEMM (the routers call it)."""
    return Bf16Linear.apply(x, w, b)


def expert_rows(self, top_k_index):
    """Each expert that some token chose, with its (slot, token) pairs (transformers' loop)."""
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        top_k_pos, token_idx = torch.where(mask[e])
        yield e, top_k_pos, token_idx


def gated_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Mixtral's and Qwen3-MoE's experts (gate/up rows, then down), each projection a bf16 GEMM."""
    out = torch.zeros_like(hidden_states)
    for e, pos, tok in expert_rows(self, top_k_index):
        gate, up = Bf16Linear.apply(hidden_states[tok], self.gate_up_proj[e], None).chunk(2, dim=-1)
        y = Bf16Linear.apply(self.act_fn(gate) * up, self.down_proj[e], None)
        out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    return out


def gpt_oss_experts_forward(self, hidden_states, router_indices=None, routing_weights=None):
    """GPT-OSS's experts (x·W + b with W [C, 2I] and [I, C]), each projection a bf16 GEMM."""
    out = torch.zeros_like(hidden_states)
    for e, pos, tok in expert_rows(self, router_indices):
        gu = Bf16Linear.apply(hidden_states[tok], self.gate_up_proj[e].t(), self.gate_up_proj_bias[e])
        y = Bf16Linear.apply(self._apply_gate(gu), self.down_proj[e].t(), self.down_proj_bias[e])
        out.index_add_(0, tok, y * routing_weights[tok, pos, None])
    return out


def embedding_forward(self, ids):
    return F.embedding(ids, Param.apply(self.weight), padding_idx=self.padding_idx)


def rmsnorm_forward(self, h):
    h = h.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return Param.apply(self.weight) * (h * torch.rsqrt(var + self.variance_epsilon))


def gemma_rmsnorm_forward(self, h):
    """Gemma's norm: (1 + w)·x̂ in fp32, w as its high plane."""
    h = h.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return (h * torch.rsqrt(var + self.eps)) * (1.0 + Param.apply(self.weight))


class StoredInput(torch.autograd.Function):
    """A decoder layer whose input is stored in bf16 for its backward, which recomputes the
    layer from that stored input (the forward itself runs on the fp32 input)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(rne(x))
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, dy):
        (stored,) = ctx.saved_tensors
        x = stored.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.layer(x)
        # The layer's parameters are leaves: their gradients accumulate here.
        torch.autograd.backward(y, dy)
        return x.grad, None


def store_inputs_in_bf16(model):
    """Every decoder layer through `StoredInput` (its other arguments, the RoPE tables and
    masks, as the model passes them). No KV cache: a recompute would append to it."""
    model.config.use_cache = False
    for layer in model.model.layers:
        def forward(hidden_states, *args, _forward=layer.forward, **kwargs):
            return StoredInput.apply(hidden_states, lambda x: _forward(x, *args, **kwargs))
        layer.forward = forward


def bf16_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in fp32 on bf16-stored Q (after RoPE), K (after RoPE) and V; the output's
    gradient is stored in bf16."""
    q, k, v = Stored.apply(query), Stored.apply(key), Stored.apply(value)
    k = modeling_llama.repeat_kv(k, module.num_key_value_groups)
    v = modeling_llama.repeat_kv(v, module.num_key_value_groups)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    # A registered attention gets no mask for plain causal attention (it is implied, as for
    # SDPA's is_causal): apply it here; a given mask is additive.
    # A sliding window comes the same way, as the `sliding_window` argument (query i sees keys
    # i − window < j ≤ i).
    if attention_mask is None:
        tq, tk = w.shape[-2], w.shape[-1]
        attention_mask = torch.full((tq, tk), float("-inf")).triu(1 + tk - tq)
        window = kwargs.get("sliding_window")
        if window is not None:
            attention_mask = attention_mask + torch.full((tq, tk), float("-inf")).tril(tk - tq - window)
    if attention_mask.dtype == torch.bool:  # SDPA's form (a sliding window): True attends
        w = w.masked_fill(~attention_mask, float("-inf"))
    else:
        w = w + attention_mask
    sinks = kwargs.get("s_aux")
    if sinks is None:
        w = F.softmax(w, dim=-1, dtype=torch.float32)
    else:
        # GPT-OSS: a per-head sink logit (its high plane) in the softmax, then dropped.
        sink = Param.apply(sinks).reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], -1)
        z = torch.cat([w, sink], dim=-1)
        w = F.softmax(z - z.max(dim=-1, keepdim=True).values, dim=-1, dtype=torch.float32)[..., :-1]
    out = torch.matmul(w, v).transpose(1, 2).contiguous()
    return GradStored.apply(out), w


def install_recipe():
    nn.Linear.forward = linear_forward
    nn.Embedding.forward = embedding_forward
    modeling_llama.LlamaRMSNorm.forward = rmsnorm_forward
    # Qwen3's own norm class: the blocks' and final norms, and q_norm/k_norm (which Qwen3Attention
    # applies to the fp32 projection output before RoPE; Q and K reach `bf16_attention` in fp32).
    modeling_qwen3.Qwen3RMSNorm.forward = rmsnorm_forward
    # Gemma 3's norms (blocks, sandwich, q_norm/k_norm, final) apply 1 + w.
    modeling_gemma3.Gemma3RMSNorm.forward = gemma_rmsnorm_forward
    # Mixtures of experts: their norms, routers (F.linear) and experts.
    for norm in (modeling_mixtral.MixtralRMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm,
                 modeling_gpt_oss.GptOssRMSNorm):
        norm.forward = rmsnorm_forward
    F.linear = functional_linear
    modeling_mixtral.MixtralExperts.forward = gated_experts_forward
    modeling_qwen3_moe.Qwen3MoeExperts.forward = gated_experts_forward
    modeling_gpt_oss.GptOssExperts.forward = gpt_oss_experts_forward
    AttentionInterface.register("megatrain_bf16", bf16_attention)


def run(case, c, seed):
    """One case: tools/golden_train.py's loop on a model built with the recipe's attention (the
    recipe's Linear, Embedding and RMSNorm are installed by `install_recipe`)."""
    golden_train.run(case, c, seed, attn_implementation="megatrain_bf16",
                     generator="tools/golden_train_bf16.py", settings=dict(c, precision="bf16"),
                     micro_grads=rne if c.get("grad_link") == "bf16" else None,
                     model_hook=store_inputs_in_bf16 if c.get("activation_dtype") == "bf16" else None)


def main():
    torch.set_num_threads(1)
    install_recipe()
    wanted = sys.argv[1:] or list(CASES)
    for i, (case, c) in enumerate(CASES.items()):
        if case in wanted:
            run(case, c, 400 + i)


if __name__ == "__main__":
    main()
