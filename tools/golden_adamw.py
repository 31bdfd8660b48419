#!/usr/bin/env python3
"""Golden data for megatrain's AdamW engine, from torch.optim.AdamW (fp32, CPU).

Writes tests/golden/adamw.safetensors. The file's metadata carries the magic
"megatrain-golden", a format version and the hyperparameters; tensors are

  init.{name}            parameters before step 1
  grad.{step}.{name}     raw gradient fed at step (1-based), before clipping
  param.{step}.{name}    parameters after the step
  m.{step}.{name} / v.{step}.{name}   Adam moments after the step
  norm.{step}            global grad norm before clipping (only in clipped cases), shape [1]

Cases: "decay_all" (weight decay on every tensor, no clipping) and "clip"
(decay_norms=False: 1-D tensors in a group without decay; clip_grad_norm_ to 1.0).
Tensor shapes are odd on purpose (SIMD tails). Run:  python3 tools/golden_adamw.py
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

MAGIC = "megatrain-golden"
VERSION = "1"
STEPS = 5
SHAPES = {"w": (19, 23), "b": (31,), "n": (16,)}


def run_case(case, lr, wd, max_norm, decay_norms, seed, out):
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.nn.Parameter(torch.randn(*s, generator=g)) for k, s in SHAPES.items()}
    if decay_norms:
        groups = [{"params": list(params.values()), "weight_decay": wd}]
    else:
        groups = [
            {"params": [p for p in params.values() if p.dim() > 1], "weight_decay": wd},
            {"params": [p for p in params.values() if p.dim() <= 1], "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for k, p in params.items():
        out[f"{case}.init.{k}"] = p.detach().clone()
    for step in range(1, STEPS + 1):
        for k, p in params.items():
            grad = torch.randn(p.shape, generator=g) * (0.5 * step)
            out[f"{case}.grad.{step}.{k}"] = grad.clone()
            p.grad = grad
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
            out[f"{case}.norm.{step}"] = norm.reshape(1).detach().clone()
        opt.step()
        for k, p in params.items():
            st = opt.state[p]
            out[f"{case}.param.{step}.{k}"] = p.detach().clone()
            out[f"{case}.m.{step}.{k}"] = st["exp_avg"].clone()
            out[f"{case}.v.{step}.{k}"] = st["exp_avg_sq"].clone()
    return {"lr": lr, "weight_decay": wd, "max_norm": max_norm, "decay_norms": decay_norms,
            "betas": [0.9, 0.999], "eps": 1e-8, "steps": STEPS}


def main():
    torch.set_num_threads(1)
    out = {}
    cases = {
        "decay_all": run_case("decay_all", 3e-3, 0.1, 0.0, True, 1, out),
        "clip": run_case("clip", 1e-2, 0.05, 1.0, False, 2, out),
    }
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "adamw.safetensors")
    meta = {"magic": MAGIC, "version": VERSION, "generator": "tools/golden_adamw.py",
            "torch": torch.__version__, "cases": json.dumps(cases)}
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata=meta)
    print(f"wrote {path}: {len(out)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
