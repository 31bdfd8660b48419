#!/usr/bin/env python3
"""PyTorch eager on the CPU with the embedded default model and batch, for comparison with
`megatrain train --demo` tokens/s (same model, batch, sequence length, optimizer and threads).

  python3 tools/bench_torch_cpu.py [--threads 2] [--steps 30]
"""
import argparse
import json
import os
import re
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM


def default_model_json():
    src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "train", "corpus.rs")).read()
    return json.loads(re.search(r'MODEL_JSON: &str = r#"(.*?)"#;', src, re.S).group(1))


def train_tokens_per_s(cfg, batch, seq, steps, threads, rows=None):
    """PyTorch eager training of the model `cfg` (config.json keys, `model_type` among them):
    tokens/s of its median step after 3 warm-up steps, and its parameter count. `rows` [batch,
    seq + 1] int64 tokens (random when None)."""
    torch.set_num_threads(threads)
    d = dict(cfg)
    d.pop("architectures", None)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    x = rows if rows is not None else torch.randint(0, config.vocab_size, (batch, seq + 1))
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    params = sum(p.numel() for p in model.parameters())
    return batch * seq / times[len(times) // 2], params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    tps, params = train_tokens_per_s(default_model_json(), a.batch, a.seq, a.steps, a.threads)
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "params": params,
                      "tokens_per_step": a.batch * a.seq, "median_step_s": a.batch * a.seq / tps,
                      "tokens_per_s": tps}))


if __name__ == "__main__":
    main()
