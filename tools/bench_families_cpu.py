#!/usr/bin/env python3
"""megatrain's CPU device against PyTorch eager, training the same small model of a family with
the same batch, sequence, optimizer and threads: tokens/s of each, and their ratio, in one run.

  python3 tools/bench_families_cpu.py [--family qwen3|gemma3|llama|qwen3_moe|mixtral|gpt_oss] [--threads 2] [--steps 30]

The shapes are the family's (Qwen3: QK-norm, head_dim 64 ≠ hidden/heads; Gemma 3: `1 + w` and
sandwich norms, QK-norm, GELU-tanh, scaled embeddings, local layers with a window of 64 over rows
of 128 and their own RoPE before a global one) at a width the CPU trains in seconds. Both run
alternately (megatrain, torch, megatrain, torch) and each side's best run is reported: megatrain
its run's tokens/s after the first step (from --metrics), torch its median step. megatrain is
target/release/megatrain unless MEGATRAIN_BIN says otherwise.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch_cpu  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BASE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=8192, rms_norm_eps=1e-6, max_position_embeddings=4096,
            tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                  rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", head_dim=96,
                  rope_theta=1e6, use_sliding_window=False, attention_bias=False),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   hidden_activation="gelu_pytorch_tanh", head_dim=96, query_pre_attn_scalar=96,
                   sliding_window=64, pad_token_id=0,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    # Qwen3-MoE shaped (Qwen3-30B-A3B's ratios at this width): 32 experts of width 128, top-4
    # renormalised, on every layer; torch runs transformers' own expert loop.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
                      head_dim=64, rope_theta=1e6, use_sliding_window=False, attention_bias=False,
                      num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                      mlp_only_layers=[], decoder_sparse_step=1),
    # GPT-OSS shaped: sinks, biases, a window of 64 on every other layer, 32 biased experts of
    # width 128 with interleaved gate/up and the clamped SwiGLU, top-4 logits then their softmax.
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_act="silu", head_dim=64,
                    intermediate_size=128, num_local_experts=32, num_experts_per_tok=4, sliding_window=64),
    # Mixtral shaped: 8 experts of width 704, top-2.
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_act="silu",
                    rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
}


def torch_run(cfg_dict, a, tokens):
    rows = torch.from_numpy(tokens[: a.batch * (a.seq + 1)].astype(np.int64)).reshape(a.batch, a.seq + 1)
    return bench_torch_cpu.train_tokens_per_s(cfg_dict, a.batch, a.seq, a.steps, a.threads, rows)


def megatrain_run(cfg_path, data_path, a, tmp):
    binary = os.environ.get("MEGATRAIN_BIN", os.path.join(ROOT, "target", "release", "megatrain"))
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [binary, "train", "--model", cfg_path, "--data", data_path, "--seq-len", str(a.seq),
           "--batch-size", str(a.batch), "--steps", str(a.steps + 1), "--lr", "2e-3",
           "--weight-decay", "0.1", "--grad-clip", "1.0", "--metrics", metrics]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = [json.loads(l) for l in open(metrics)]
    # Steps after the first (which includes the first touch of every buffer).
    later = lines[1:]
    tokens = sum(l["tokens"] for l in later)
    wall = sum(l["wall_s"] for l in later)
    return tokens / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(FAMILIES), default="gemma3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cfg = dict(BASE, **FAMILIES[a.family])
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg["vocab_size"], size=(a.steps + 2) * a.batch * (a.seq + 1), dtype=np.uint16)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, data_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "data.bin")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        tokens.tofile(data_path)
        ours, theirs, params = [], [], 0
        for _ in range(a.rounds):
            ours.append(megatrain_run(cfg_path, data_path, a, tmp))
            t, params = torch_run(cfg, a, tokens)
            theirs.append(t)
    print(json.dumps({"family": a.family, "params": params, "threads": a.threads, "batch": a.batch,
                      "seq": a.seq, "torch": torch.__version__, "megatrain_tokens_per_s": max(ours),
                      "torch_tokens_per_s": max(theirs), "ratio": max(ours) / max(theirs),
                      "runs": {"megatrain": ours, "torch": theirs}}))


if __name__ == "__main__":
    main()
