#!/usr/bin/env python3
"""Host bytes per parameter and the largest model that fits 0.5, 1 and 1.5 TiB of RAM, for each
mode and Adam state format, from `megatrain plan --json` (the same layout code the trainer
allocates). Prints the Markdown table in docs/plan.md.

    cargo build --release && python3 tools/plan_capacity.py [path/to/megatrain]

Bytes per parameter are the planner's for llama-120b (alignment included; they vary by < 0.1 B
across Llama shapes). "Largest model" is the planner's usable share of the RAM (`USABLE`, 90%)
divided by those bytes: the state alone; host activations (a few GiB to tens of GiB, set by
--tokens-per-step) come out of the same share, so leave a margin or check the model with
`megatrain plan`.
"""

import json
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/megatrain"
USABLE = 0.9  # src/plan/mod.rs: USABLE
TIB = 1 << 40
RAMS = [0.5, 1.0, 1.5]


def bytes_per_param(mode: str, state: str) -> float:
    out = subprocess.run(
        [BIN, "plan", "--model", "llama-120b", "--machine", "h200-1.5tb",
         "--mode", mode, "--adam-state", state, "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)["plan"]["memory"]["host_bytes_per_param"]


def main() -> None:
    head = "| mode | Adam state | host B/param | " + " | ".join(
        f"largest model, {r:g} TiB" for r in RAMS) + " |"
    print(head)
    print("|" + "---|" * (3 + len(RAMS)))
    for mode in ["exact", "lean"]:
        for state in ["fp32", "bf16", "int8"]:
            bpp = bytes_per_param(mode, state)
            cells = [f"{USABLE * r * TIB / bpp / 1e9:.0f}B" for r in RAMS]
            print(f"| {mode} | {state} | {bpp:.1f} | " + " | ".join(cells) + " |")
    cells = [f"{USABLE * r * TIB / 12 / 1e9:.0f}B" for r in RAMS]
    print("| MegaTrain (claimed) | bf16 params and grads, fp32 m, v; no fp32 master | 12 | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
