#!/usr/bin/env python3
"""Golden data for supervised fine-tuning with `megatrain prepare --format chat|prompt-completion`
and packed `megatrain train`, from PyTorch + transformers (fp32, eager), computed the way
transformers defines it, without packing:

  every document is run through the model on its own (positions from 0, no other document in
  sight), with labels −100 where the loss mask is 0 — for chat the mask is transformers' own
  `apply_chat_template(..., return_assistant_tokens_mask=True)` (the fixture tokenizer's template
  has {% generation %} blocks); for prompt-completion the completion and the EOS;
  the step's loss is the sum over its documents' trained tokens divided by the number of trained
  tokens of the whole step (all its micro-batches: transformers' Trainer since 4.46);
  global-norm clipping; torch.optim.AdamW (weight decay on every tensor); constant lr.
  A mixture of experts with `output_router_logits` adds `router_aux_loss_coef / M` times each
  micro-batch's load-balancing loss: transformers' `load_balancing_loss_func` over the router
  logits of all the micro-batch's documents — what transformers computes for a padded batch with
  its `attention_mask` (padding counts in no part of it).

Which documents make a step follows megatrain's documented packing: documents in file order,
greedily into rows of T tokens (never split; none here is longer than T), B rows per micro-batch,
M micro-batches per step, rows in order (no shuffle). `--packing off`: one document per row.

For each case writes tests/golden/sft_{case}/ with
  init/               the initial weights (the CLI's --init-from)
  data.jsonl          the samples (prepared by the test with tests/fixtures/chat/gen)
  golden.safetensors  metadata: magic, version, settings (JSON); tensors: loss [S], grad_norm [S],
                      final.{name} (weights after S steps)
Run:  python3 tools/golden_sft.py [CASE…]   (needs torch, transformers; tools/sft_example.py's venv)
"""
import json
import os
import random
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

MAGIC, VERSION = "megatrain-golden", "1"
HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tests", "fixtures", "chat", "gen")
BASE = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
            hidden_act="silu", tie_word_embeddings=False)
CASES = {
    # Several documents per row, two micro-batches per step.
    "chat": dict(format="chat", packing="on", B=2, T=160, M=2, steps=3, clip=1.0, lr=3e-3, wd=0.1),
    # One document per row.
    "chat_unpacked": dict(format="chat", packing="off", B=3, T=96, M=1, steps=3, clip=0.0, lr=3e-3, wd=0.0),
    "prompt_completion": dict(format="prompt-completion", packing="on", B=2, T=64, M=2, steps=3, clip=1.0,
                              lr=3e-3, wd=0.1),
    # Mixtral with its load-balancing loss (coefficient 0.5, so that it matters) over packed rows
    # whose tails are padding: the padding must count in neither the loss nor its gradient.
    "chat_mixtral_aux": dict(format="chat", packing="on", B=2, T=160, M=2, steps=3, clip=1.0, lr=3e-3, wd=0.1,
                             model_type="mixtral",
                             config=dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                         router_aux_loss_coef=0.5)),
}


def samples(kind, n, seed):
    rng = random.Random(seed)
    ops = [("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)]
    out = []
    for _ in range(n):
        turns = []
        for _ in range(rng.choice([1, 1, 2])):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            name, f = rng.choice(ops)
            turns.append((f"What is {a} {name} {b}?", f"{a} {name} {b} is {f(a, b)}."))
        if kind == "prompt-completion":
            q, r = turns[0]
            out.append({"prompt": q, "completion": " " + r})
            continue
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are a calculator."})
        for q, r in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
        out.append({"messages": messages})
    return out


def document(tok, kind, s):
    """(ids, mask): mask[i] = token i is a trained target (mask[0] is always 0)."""
    if kind == "chat":
        enc = tok.apply_chat_template(s["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    else:
        p = tok(s["prompt"])["input_ids"]
        c = tok(s["completion"], add_special_tokens=False)["input_ids"]
        ids = p + c + [tok.eos_token_id]
        mask = [0] * len(p) + [1] * (len(c) + 1)
    mask[0] = 0
    return ids, mask


def rows_of(docs, T, packing):
    rows, row, fill = [], [], 0
    for d in docs:
        n = len(d[0])
        assert n <= T, f"document of {n} tokens > T={T}"
        if row and (fill + n > T or packing == "off"):
            rows.append(row)
            row, fill = [], 0
        row.append(d)
        fill += n
    if row:
        rows.append(row)
    return rows


def run(case, c, seed):
    root = os.path.join(HERE, "..", "tests", "golden", f"sft_{case}")
    os.makedirs(root, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    B, T, M, S = c["B"], c["T"], c["M"], c["steps"]
    data = samples(c["format"], 200, seed)
    docs = [document(tok, c["format"], s) for s in data]
    rows = rows_of(docs, T, c["packing"])
    assert len(rows) >= B * M * S, f"{case}: {len(rows)} rows < {B * M * S}"
    used = B * M * S
    n_docs = sum(len(r) for r in rows[:used])
    # Keep only what the run reads (and one row more, so the file is not just one batch).
    keep = sum(len(r) for r in rows[:used + 1])
    with open(os.path.join(root, "data.jsonl"), "w") as f:
        for s in data[:keep]:
            f.write(json.dumps(s) + "\n")

    g = torch.Generator().manual_seed(seed)
    cfg = AutoConfig.for_model(c.get("model_type", "llama"), **BASE, vocab_size=len(tok), **c.get("config", {}))
    moe = getattr(cfg, "output_router_logits", False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in n
                    else 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(os.path.join(root, "init"), safe_serialization=True)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=c["wd"])
    losses, norms = [], []
    r = 0
    for _ in range(S):
        opt.zero_grad(set_to_none=True)
        micro = [[d for row in rows[r + m * B:r + (m + 1) * B] for d in row] for m in range(M)]
        r += B * M
        trained = sum(sum(mask[1:]) for mb in micro for _, mask in mb)
        total = 0.0
        for mb in micro:
            loss = 0.0
            router = []  # per document: per layer [tokens, E]
            for ids, mask in mb:
                x = torch.tensor([ids])
                out = model(input_ids=x)
                logits = out.logits[0].float()
                labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
                loss = loss + F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
                if moe:
                    router.append(out.router_logits)
            loss = loss / trained
            if moe:
                per_layer = tuple(torch.cat([doc[l] for doc in router]) for l in range(cfg.num_hidden_layers))
                aux = load_balancing_loss_func(per_layer, cfg.num_local_experts, cfg.num_experts_per_tok, None)
                loss = loss + cfg.router_aux_loss_coef * aux / M
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), c["clip"] if c["clip"] > 0 else float("inf"))
        losses.append(total)
        norms.append(norm.item())
        opt.step()
    out = {"loss": torch.tensor(losses, dtype=torch.float32), "grad_norm": torch.tensor(norms, dtype=torch.float32)}
    for n, p in model.named_parameters():
        out[f"final.{n}"] = p.detach().clone()
    settings = dict(c, documents=n_docs, rows=used)
    meta = {"magic": MAGIC, "version": VERSION, "generator": "tools/golden_sft.py", "torch": torch.__version__,
            "settings": json.dumps(settings)}
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(root, "golden.safetensors"), metadata=meta)
    print(f"wrote {root}: {n_docs} documents in {used} rows, losses {losses}", file=sys.stderr)


def main():
    torch.set_num_threads(1)
    only = set(sys.argv[1:])
    for i, (case, c) in enumerate(CASES.items()):
        if not only or case in only:
            run(case, c, 700 + i)


if __name__ == "__main__":
    main()
