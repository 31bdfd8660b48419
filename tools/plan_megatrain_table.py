#!/usr/bin/env python3
"""Predicted tokens/s and TFLOP/s of `megatrain plan` for each model × GPU of issue #17, beside
MegaTrain's published figures where we know them. Prints the Markdown table in docs/plan.md.

    cargo build --release && python3 tools/plan_megatrain_table.py [path/to/megatrain]

Every figure of ours is a prediction (`megatrain plan --precision bf16`, the planner's sourced
kernel efficiencies), never a measurement. Per pair it takes the first host-state configuration
that fits the preset machine's RAM: exact mode with fp32 Adam moments, then lean mode with fp32,
bf16, int8 moments. TFLOP/s counts 6·N FLOPs per token, as MegaTrain's figures do.
"""

import json
import subprocess
import sys

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/megatrain"
MODELS = ["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "llama-3-8b", "llama-3-70b"]
MACHINES = [("H100", "h100-512gb"), ("H200", "h200-1.5tb"), ("GH200", "gh200-480gb")]
CONFIGS = [("exact", "fp32"), ("lean", "fp32"), ("lean", "bf16"), ("lean", "int8")]
# MegaTrain's published figures (TFLOP/s by its 6·N·tokens count), by (model, GPU): quoted in
# issue #17 and in our design brief from the MegaTrain paper (arXiv 2604.05091) and README.
MEGATRAIN = {
    ("qwen2.5-7b", "H100"): 272.0,
    ("qwen2.5-32b", "H100"): 259.0,
}


def plan(model: str, machine: str, mode: str, state: str) -> dict:
    out = subprocess.run(
        [BIN, "plan", "--model", model, "--machine", machine, "--precision", "bf16",
         "--mode", mode, "--adam-state", state, "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    print("| model | GPU | host state | predicted tokens/s | predicted TFLOP/s (6·N) | GEMM / attention / "
          "elementwise of GPU time | bound by | MegaTrain published | ours ÷ MegaTrain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        for gpu, machine in MACHINES:
            found = None
            for mode, state in CONFIGS:
                v = plan(model, machine, mode, state)
                if v["plan"]["fits"]:
                    found = (mode, state, v)
                    break
            if found is None:
                print(f"| {model} | {gpu} | does not fit the preset's RAM | - | - | - | - | - | - |")
                continue
            mode, state, v = found
            t = v["plan"]["time"]
            n = v["plan"]["params"]
            tflops = 6.0 * n * t["tokens_per_s"] / 1e12
            split = t["compute_split"]
            total = split["gemm_s"] + split["attention_s"] + split["elementwise_s"]
            parts = " / ".join(
                f"{100 * split[k] / total:.0f}%" for k in ["gemm_s", "attention_s", "elementwise_s"])
            bytes_pp = v["plan"]["memory"]["host_bytes_per_param"]
            theirs = MEGATRAIN.get((model, gpu))
            theirs_txt = f"{theirs:.0f} TFLOP/s" if theirs else "not published (to our knowledge)"
            ratio = f"{tflops / theirs:.2f}×" if theirs else "-"
            print(f"| {model} | {gpu} | {mode}, {state} moments ({bytes_pp:.1f} B/param) | "
                  f"{t['tokens_per_s']:,.0f} | {tflops:.0f} | {parts} | {t['bottleneck']} | "
                  f"{theirs_txt} | {ratio} |")


if __name__ == "__main__":
    main()
