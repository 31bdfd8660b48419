#!/usr/bin/env python3
"""megatrain's CPU causal attention beside PyTorch's scaled_dot_product_attention, in one run:
same shapes (batch 1, GQA), same thread count, forward and forward + backward, alternating
megatrain and torch per sequence length so both see the same machine load.

    /tmp/tvenv/bin/python tools/bench_attention_cpu.py [--bin target/release/megatrain]
        [--seq 4096,8192,16384] [--heads 8] [--kv-heads 2] [--head-dim 64] [--threads 2] [--reps 3]

Prints milliseconds, causal TFLOP/s (2·T²·hd·heads per forward, the backward counted as 2.5
forwards) and megatrain's speed as a ratio of torch's (> 1: megatrain is faster).
"""
import argparse
import json
import os
import subprocess
import time

import torch
import torch.nn.functional as F


def torch_case(t, heads, kv, hd, reps):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, t, hd, generator=g, requires_grad=True)
    k = torch.randn(1, kv, t, hd, generator=g, requires_grad=True)
    v = torch.randn(1, kv, t, hd, generator=g, requires_grad=True)
    do = torch.randn(1, heads, t, hd, generator=g)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(do)

    def median(f):
        f()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    return median(fwd), median(fwd_bwd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/megatrain")
    ap.add_argument("--seq", default="4096,8192,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    print(f"causal attention, batch 1, {a.heads} heads / {a.kv_heads} kv heads, head dim {a.head_dim}, "
          f"{a.threads} threads; torch {torch.__version__}")
    print(f"{'T':>7} {'pass':>8} {'megatrain ms':>13} {'torch ms':>9} {'megatrain TF/s':>15} {'torch TF/s':>11} {'ratio':>6}")
    for t in [int(x) for x in a.seq.split(",")]:
        out = subprocess.run([a.bin, "bench", "attention", "--json", "--seq", str(t), "--heads", str(a.heads),
                              "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim), "--reps", str(a.reps)],
                             env=env, check=True, capture_output=True, text=True).stdout
        c = json.loads(out)["cases"][0]
        tf, tfb = torch_case(t, a.heads, a.kv_heads, a.head_dim, a.reps)
        flops = c["fwd_flops"]
        for name, ours, theirs, mult in [("fwd", c["fwd_s"], tf, 1.0), ("fwd+bwd", c["fwd_bwd_s"], tfb, 3.5)]:
            print(f"{t:>7} {name:>8} {ours * 1e3:>13.1f} {theirs * 1e3:>9.1f} {mult * flops / ours / 1e12:>15.4f} "
                  f"{mult * flops / theirs / 1e12:>11.4f} {theirs / ours:>6.2f}")


if __name__ == "__main__":
    main()
