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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = default_model_json()
    d.pop("architectures", None)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1))
    times = []
    for i in range(a.steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "params": params,
                      "tokens_per_step": a.batch * a.seq, "median_step_s": med,
                      "tokens_per_s": a.batch * a.seq / med}))


if __name__ == "__main__":
    main()
