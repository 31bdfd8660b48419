#!/usr/bin/env python3
"""How far blockwise 8-bit Adam (torchao's AdamW8bit: the dynamic-map algorithm of Dettmers et
al., arXiv 2110.02861, as in bitsandbytes) moves rarely seen embedding rows, against exact fp32
AdamW (torch.optim.AdamW), on this CPU.

Why: v (exp_avg_sq) is quantised per block of 2,048 elements with the unsigned dynamic map, whose
smallest non-zero entry is 3.25e-7 of the block's absmax. An element whose v is below half of
that (|g| below ~4e-4 of the block's largest |g|, as v ~ g²) gets v code 0, while its m (signed
map, linear in g, reaching 5.5e-7 of absmax) keeps a code. On the next step without gradient (a
row not seen again) the update is lr·m̂/(sqrt(0)+eps): at step 2 about 0.47·|g|/eps·lr, i.e. up
to ~1.9e4·max|g|·lr (~190·lr here, max|g| = 1e-2), where exact AdamW moves at most ~lr.

Case (regenerable exactly by a Rust test: elementwise formulas of i in 0..N and the step only):
  N = 8 blocks of 2,048 float32; w_i = +0.02 for even i, -0.02 for odd i
  lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0, block size 2,048
  g_i = s_b * 10^(-6 f_i) * sign_i, b = i // 2048, s_b = 1e-2,
        f_i = ((i*7919) % 2048) / 2047   (a permutation within each block: 6 decades of |g|),
        sign_i = -1 if (i*31) % 3 == 0 else +1;  computed in float64, then cast to float32
  step 1: every block gets g; steps 2..=30: blocks 0..4 ("frequent rows") get g again,
          blocks 4..8 ("rare rows") get 0.
For each optimiser: max over steps and elements of |Δw|/lr (and its step), max |w|, the number
of elements that moved more than 10·lr in some single step (and the most in one step), for all
blocks, the frequent blocks and the rare blocks; for the 8-bit ones also how many rare elements
had v code 0 with m code non-zero after step 1. "grad_f32_sha256" is the hash of the step-1
gradient's float32 little-endian bytes, for a regenerating test to check against.

torch.compile is bypassed as in tools/golden_adam8bit.py (torchao's step function runs eagerly).
bitsandbytes' AdamW8bit is run too where it imports (0.50 has a CPU kernel, a plain PyTorch
dequantise-update-requantise; its block size is fixed at 256, so "block" is reported, and
"zero_v_dequantises_to" says what its quantiser here makes of a v of 0 in a block of absmax 1);
where it does not, its entry says why. Run:

  python3 -m venv /tmp/v && /tmp/v/bin/pip install torch torchao numpy [bitsandbytes]
  /tmp/v/bin/python tools/int8_adam_blowup.py [out.json]
"""
import hashlib
import json
import sys

import numpy as np
import torch
import torchao
from torchao.optim import AdamW8bit

BLOCK = 2048
BLOCKS = 8
N = BLOCKS * BLOCK
FREQUENT = 4  # blocks 0..FREQUENT get a gradient every step; the rest only at step 1
STEPS = 30
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.0
BLOCK_SCALE = 1e-2


def init():
    i = np.arange(N)
    return np.where(i % 2 == 0, 0.02, -0.02).astype(np.float32)


def grad(step):
    i = np.arange(N, dtype=np.int64)
    f = ((i * 7919) % BLOCK).astype(np.float64) / 2047.0
    sign = np.where((i * 31) % 3 == 0, -1.0, 1.0)
    g = BLOCK_SCALE * np.power(10.0, -6.0 * f) * sign
    if step > 1:
        g = np.where(i // BLOCK < FREQUENT, g, 0.0)
    return g.astype(np.float32)


def run(make_opt, name):
    p = torch.nn.Parameter(torch.from_numpy(init()))
    opt = make_opt(p)
    rare = np.arange(N) // BLOCK >= FREQUENT
    prev = init().astype(np.float64)
    ever = np.zeros(N, dtype=bool)
    stats = {k: {"max_dw_over_lr": 0.0, "max_dw_step": 0, "max_abs_w": float(np.abs(prev).max()),
                 "elements_over_10lr": 0, "most_over_10lr_in_one_step": 0}
             for k in ("all", "frequent", "rare")}
    extra = {}
    for step in range(1, STEPS + 1):
        p.grad = torch.from_numpy(grad(step))
        opt.step()
        w = p.detach().numpy().astype(np.float64)
        r = np.abs(w - prev) / LR
        over = r > 10.0
        ever |= over
        for k, sel in (("all", slice(None)), ("frequent", ~rare), ("rare", rare)):
            s = stats[k]
            m = float(r[sel].max())
            if m > s["max_dw_over_lr"]:
                s["max_dw_over_lr"], s["max_dw_step"] = m, step
            s["max_abs_w"] = max(s["max_abs_w"], float(np.abs(w[sel]).max()))
            s["most_over_10lr_in_one_step"] = max(s["most_over_10lr_in_one_step"],
                                                   int(over[sel].sum()))
        if step == 1 and name != "fp32":
            st = opt.state[p]
            if name == "torchao_adamw8bit":
                assert type(st["exp_avg"]).__name__ == "OptimState8bit", "not quantised"
                assert st["exp_avg"].block_size == BLOCK
                mq, vq = st["exp_avg"], st["exp_avg_sq"]
                mc, vc, mmap, vmap = mq.codes, vq.codes, mq.qmap, vq.qmap
            else:
                assert st["state2"].dtype == torch.uint8, "not quantised"
                mc, vc, mmap, vmap = st["state1"], st["state2"], st["qmap1"], st["qmap2"]
                extra["block"] = N // st["absmax2"].numel()
            m0 = mmap[mc.int()] == 0
            v0 = vmap[vc.int()] == 0
            extra["after_step1_rare_v_zero"] = int(v0.numpy()[rare].sum())
            extra["after_step1_rare_v_zero_m_nonzero"] = int((v0 & ~m0).numpy()[rare].sum())
            extra["unsigned_qmap_smallest_nonzero"] = float(vmap[vmap > 0].min())
            extra["signed_qmap_smallest_nonzero"] = float(mmap[mmap > 0].min())
        prev = w
    stats["all"]["elements_over_10lr"] = int(ever.sum())
    stats["frequent"]["elements_over_10lr"] = int(ever[~rare].sum())
    stats["rare"]["elements_over_10lr"] = int(ever[rare].sum())
    stats.update(extra)
    return stats


def main():
    torch.set_num_threads(1)
    torch.compile = lambda fn, **_: fn  # eager: torchao's own step function, no compiler
    fp32 = run(lambda p: torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                           foreach=False), "fp32")
    q8 = run(lambda p: AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 block_size=BLOCK), "torchao_adamw8bit")
    try:
        import bitsandbytes as bnb
        bnb_version = bnb.__version__
        q8b = run(lambda p: bnb.optim.AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS,
                                                 weight_decay=WD), "bitsandbytes_adamw8bit")
        # what bitsandbytes' quantiser on this device makes of a 0 in a block whose absmax is 1
        probe = torch.zeros(256)
        probe[-1] = 1.0
        for key, signed in (("zero_v_dequantises_to", False), ("zero_m_dequantises_to", True)):
            qmap = bnb.functional.create_dynamic_map(signed=signed).float()
            codes, _ = bnb.functional.quantize_blockwise(probe, code=qmap, blocksize=256)
            q8b[key] = float(qmap[codes[0].long()])
    except Exception as e:  # not installed, or no kernel for this device
        bnb_version, q8b = None, f"not run: {type(e).__name__}: {e}"
    out = {"case": {"n": N, "block": BLOCK, "frequent_blocks": FREQUENT, "steps": STEPS,
                    "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                    "grad_f32_sha256": hashlib.sha256(
                        grad(1).astype("<f4").tobytes()).hexdigest()},
           "fp32": fp32, "torchao_adamw8bit": q8, "bitsandbytes_adamw8bit": q8b,
           "torch": torch.__version__, "torchao": torchao.__version__,
           "bitsandbytes": bnb_version}
    text = json.dumps(out, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
