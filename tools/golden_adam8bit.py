#!/usr/bin/env python3
"""Golden data for megatrain's int8 Adam state (`--adam-state int8`), from a published
implementation of the same algorithm: torchao's AdamW8bit (blockwise dynamic 8-bit AdamW of
Dettmers et al., arXiv 2110.02861, the algorithm of bitsandbytes' 8-bit Adam), run on this CPU.

Writes tests/golden/adam8bit.safetensors. One parameter tensor of N = 4 blocks of 2,048 elements
(torchao's blocks run over the flattened tensor from its start, as megatrain's run over a unit),
updated for STEPS steps with gradients megatrain regenerates bit for bit (`grad` below: a 32-bit
hash, exact float32 arithmetic), so only the states are stored:

  qmap.signed / qmap.unsigned     torchao's 256-entry maps, float32
  init                            parameters before step 1
  {step}.param                    parameters after the step
  {step}.m.codes, {step}.m.scale  exp_avg: uint8 codes, float32 absmax per block
  {step}.v.codes, {step}.v.scale  exp_avg_sq, likewise

for the steps in RECORDED. Each block's gradients have their own magnitude (1 down to 1e-4:
torchao clips a block's absmax to at least 1e-12, which bitsandbytes and megatrain do not, so
every v absmax here stays above it) and
span three decades within it, so v spans the dynamic map's six (a gradient far below its
block's absmax has v quantised to 0 and a step of lr·m/ε: the algorithm's known blow-up, which
makes element trajectories chaotic and is kept out of this comparison). torch.compile is bypassed (torchao's
step function runs eagerly: the same operations, no compiler needed). Run:

  python3 -m venv /tmp/v && /tmp/v/bin/pip install torch torchao safetensors numpy
  /tmp/v/bin/python tools/golden_adam8bit.py
"""
import json
import os
import sys

import numpy as np
import torch
import torchao
from safetensors.torch import save_file
from torchao.optim import AdamW8bit

MAGIC = "megatrain-golden"
VERSION = "1"
BLOCK = 2048
N = 4 * BLOCK
STEPS = 300
RECORDED = [1, 2, 3, 10, 50, 100, 200, 299, 300]
LR, BETAS, EPS, WD = 2e-3, (0.9, 0.999), 1e-8, 0.01
BLOCK_SCALE = np.array([1.0, 1e-2, 1e-3, 1e-4], dtype=np.float32)
DECADES = np.array([1.0, 0.1, 0.01, 0.001], dtype=np.float32)


def hash32(x):
    """lowbias32 on uint32 arrays (megatrain::optim::moments::hash32)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def uniform(h):
    """[-1, 1) from a hash, exactly representable."""
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-23) - np.float32(1.0)


def grad(step):
    """Step `step`'s gradient, from hashes of (element, step): a random sign, a decade of the
    block's scale (1, 0.1, 0.01 or 0.001 of it) and a magnitude in [0.5, 1) of that; every
    operation an exact or float32 one, so megatrain recomputes it bit for bit. Within a block,
    v spans 6 decades: the dynamic map's whole range, none of it below."""
    i = np.arange(N, dtype=np.uint32)
    h = hash32(i ^ hash32(np.full(N, step, dtype=np.uint32) * np.uint32(0x9E3779B9)))
    h2 = hash32(h ^ np.uint32(0x5BD1E995))
    u = uniform(h)
    decade = DECADES[h2 & np.uint32(3)]
    scale = np.repeat(BLOCK_SCALE, BLOCK)
    mag = np.float32(0.5) + np.float32(0.25) * (u + np.float32(1.0))
    sign = np.where((h2 >> np.uint32(2)) & np.uint32(1), np.float32(-1.0), np.float32(1.0))
    return ((sign * mag) * decade) * scale


def init():
    i = np.arange(N, dtype=np.uint32)
    return uniform(hash32(i ^ np.uint32(0xA5A5A5A5))) * np.float32(0.5)


def main():
    torch.set_num_threads(1)
    torch.compile = lambda fn, **_: fn  # eager: torchao's own step function, no compiler
    p = torch.nn.Parameter(torch.from_numpy(init()))
    opt = AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, block_size=BLOCK)
    out = {"init": p.detach().clone()}
    for step in range(1, STEPS + 1):
        p.grad = torch.from_numpy(grad(step))
        opt.step()
        if step == 1:
            st = opt.state[p]
            assert type(st["exp_avg"]).__name__ == "OptimState8bit", "not quantised"
            out["qmap.signed"] = st["exp_avg"].qmap.clone()
            out["qmap.unsigned"] = st["exp_avg_sq"].qmap.clone()
        if step in RECORDED:
            st = opt.state[p]
            out[f"{step}.param"] = p.detach().clone()
            for name, key in [("m", "exp_avg"), ("v", "exp_avg_sq")]:
                out[f"{step}.{name}.codes"] = st[key].codes.clone()
                out[f"{step}.{name}.scale"] = st[key].scale.clone()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "adam8bit.safetensors")
    case = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "block": BLOCK,
            "n": N, "steps": STEPS, "recorded": RECORDED,
            "block_scale": [float(x) for x in BLOCK_SCALE]}
    meta = {"magic": MAGIC, "version": VERSION, "generator": "tools/golden_adam8bit.py",
            "torch": torch.__version__, "torchao": torchao.__version__, "case": json.dumps(case)}
    save_file({k: v.contiguous() for k, v in out.items()}, path, metadata=meta)
    print(f"wrote {path}: {len(out)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
