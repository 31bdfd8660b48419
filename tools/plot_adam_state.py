#!/usr/bin/env python3
"""Train the demo model once per Adam state format and plot the three loss curves in one SVG.

    cargo build --release
    python3 tools/plot_adam_state.py [--bin target/release/megatrain] [--out docs/adam-state.svg]

Each run is `megatrain train --demo --adam-state FMT --val-batches 32` (600 steps, the demo's own
settings, seed 0) in a temporary directory (or `--dir DIR`, where finished runs are reused). The SVG shows the training loss (a 20-step moving
mean) and the validation loss at each validation step; the table printed at the end has the final
validation losses and their difference from fp32's. Standard library only.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

FORMATS = [("fp32", "#1f77b4"), ("bf16", "#2ca02c"), ("int8", "#d62728")]


def train(binary: str, fmt: str, root: Path) -> list[dict]:
    metrics = root / fmt / "demo" / "metrics.jsonl"
    if metrics.exists():  # a finished run from an earlier `--dir` invocation
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if rows and rows[-1]["step"] == 600 and rows[-1].get("val_loss") is not None:
            return rows
    subprocess.run(
        [binary, "train", "--demo", "--demo-dir", str(root / fmt), "--adam-state", fmt,
         "--val-batches", "32"],
        check=True, stdout=subprocess.DEVNULL,
    )
    text = metrics.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def moving_mean(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def svg(runs: dict[str, list[dict]]) -> str:
    w, h, left, right, top, bottom = 720, 420, 60, 20, 30, 50
    steps = max(r["step"] for rows in runs.values() for r in rows)
    losses = [r["loss"] for rows in runs.values() for r in rows[20:]]
    lo, hi = min(losses) * 0.95, max(losses) * 1.02

    def x(step: float) -> float:
        return left + (w - left - right) * step / steps

    def y(loss: float) -> float:
        return top + (h - top - bottom) * (hi - loss) / (hi - lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="18" text-anchor="middle">demo model, 600 steps: training '
             'loss (20-step mean, lines) and validation loss (dots) by Adam state format</text>']
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for s in range(0, steps + 1, 100):
        parts.append(f'<text x="{x(s):.1f}" y="{h - bottom + 16}" text-anchor="middle">{s}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">step</text>')
    for n, (fmt, color) in enumerate(FORMATS):
        rows = runs[fmt]
        smooth = moving_mean([r["loss"] for r in rows], 20)
        pts = " ".join(f"{x(r['step']):.1f},{y(max(min(l, hi), lo)):.1f}"
                       for r, l in zip(rows, smooth))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{pts}"/>')
        for r in rows:
            if r.get("val_loss") is not None:
                parts.append(f'<circle cx="{x(r["step"]):.1f}" cy="{y(r["val_loss"]):.1f}" '
                             f'r="3.5" fill="{color}"/>')
        ly = top + 20 + 18 * n
        parts.append(f'<line x1="{w - 170}" x2="{w - 145}" y1="{ly}" y2="{ly}" '
                     f'stroke="{color}" stroke-width="3"/>')
        final = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
        parts.append(f'<text x="{w - 140}" y="{ly + 4}">{fmt} (val {final:.4f})</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/megatrain")
    ap.add_argument("--out", default="docs/adam-state.svg")
    ap.add_argument("--dir", help="keep the runs here (finished ones found there are reused)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        runs = {fmt: train(args.bin, fmt, root) for fmt, _ in FORMATS}
    Path(args.out).write_text(svg(runs))
    base = [r["val_loss"] for r in runs["fp32"] if r.get("val_loss") is not None][-1]
    print("| Adam state | final val loss | vs fp32 |")
    print("|---|---|---|")
    for fmt, _ in FORMATS:
        final = [r["val_loss"] for r in runs[fmt] if r.get("val_loss") is not None][-1]
        print(f"| {fmt} | {final:.4f} | {100 * (final - base) / base:+.2f}% |")


if __name__ == "__main__":
    main()
