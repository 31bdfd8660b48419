#!/usr/bin/env python3
"""megatrain's CPU AdamW by Adam state format next to PyTorch's and torchao's, in one run.

    cargo build --release
    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch torchao
    /tmp/tvenv/bin/python tools/bench_torch_adam.py [--params 64M] [--threads 2] [--rounds 3]

Rounds alternate: `megatrain bench adam --json` (fp32, bf16 and int8 moments, each beside a STREAM
triad), then torch.optim.AdamW (fused=True, then foreach=True) and torchao's AdamW8bit (block
2048, the same algorithm as `--adam-state int8`) on the same number of parameters split into ten
tensors, with the same thread count. Each figure is the median over the round's iterations; the
table prints the median over rounds. Bytes per parameter are what the update must move at least:
fp32 28 (read p, g, m, v; write p, m, v), bf16 20, int8 16 + the block scales.
"""

import argparse
import json
import statistics
import subprocess
import time

import torch

BYTES = {"fp32": 28.0, "bf16": 20.0, "int8": 16.0 + 16.0 / 2048}


def parse_count(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def megatrain(binary: str, params: str, threads: int, reps: int) -> dict[str, float]:
    out = subprocess.run(
        [binary, "bench", "adam", "--params", params, "--threads", str(threads),
         "--reps", str(reps), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    rates = {f"megatrain {c['state']}": c["params_per_s"] for c in report["adam"]}
    rates["triad GB/s"] = report["triad"]["gbytes_per_s"]
    return rates


def torch_rate(make, numel: int, reps: int) -> float:
    tensors = [torch.nn.Parameter(torch.randn(numel // 10)) for _ in range(10)]
    for t in tensors:
        t.grad = torch.randn_like(t) * 1e-2
    opt = make(tensors)
    opt.step()  # allocate the state
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return numel / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/megatrain")
    ap.add_argument("--params", default="64M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    numel = parse_count(args.params)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    peers = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
    }
    try:
        from torchao.optim import AdamW8bit

        peers["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, block_size=2048, **kw)
    except ImportError as e:
        print(f"torchao not installed ({e}): its AdamW8bit is left out")
    rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, rate in megatrain(args.bin, args.params, args.threads, args.reps).items():
            rounds.setdefault(name, []).append(rate)
        for name, make in peers.items():
            rounds.setdefault(name, []).append(torch_rate(make, numel, args.reps))
    triad = statistics.median(rounds.pop("triad GB/s"))
    print(f"{numel} params, {args.threads} threads, torch {torch.__version__}; "
          f"median of {args.rounds} alternating rounds; triad {triad:.1f} GB/s")
    print("| optimizer | M params/s | B/param (at least) | GB/s | vs triad |")
    print("|---|---|---|---|---|")
    for name, rates in rounds.items():
        fmt = "int8" if "8bit" in name or "int8" in name else (
            "bf16" if "bf16" in name else "fp32")
        r = statistics.median(rates)
        gbps = r * BYTES[fmt] / 1e9
        print(f"| {name} | {r / 1e6:.0f} | {BYTES[fmt]:.1f} | {gbps:.1f} | "
              f"{100 * gbps / triad:.0f}% |")


if __name__ == "__main__":
    main()
