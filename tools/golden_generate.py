#!/usr/bin/env python3
"""Golden data for `megatrain generate`: transformers' greedy generation (fp32, eager,
`do_sample=False`) from tiny random models, with the fixture tokenizer tests/fixtures/chat/gen.

For each case writes tests/golden/generate_{case}/ with
  model/          config.json, generation_config.json (eos_token_id: the tokenizer's EOS),
                  model.safetensors and the fixture tokenizer's files — what `megatrain generate
                  --model` loads (and `megatrain selftest --goldens` runs on any device)
  expected.json   {"prompt", "chat", "max_new_tokens", "prompt_ids", "tokens", "margins"}
                  tokens: what model.generate() appended (an EOS that stopped it included);
                  margins: at each new token, its logit minus the runner-up's (all well above
                  fp32 rounding, so the golden holds on any correct implementation)

The weights are drawn wide (std 0.5; norm weights 1 + 0.3·randn) so the logits spread out and
the greedy choice is never a near-tie; a seed is kept only if every margin is ≥ 0.05 and the
continuation is not one token repeated (a model that repeats a token tests the sequence
handling of nothing). Cases:
  llama   GQA Llama, a plain prompt (the tokenizer's BOS added, as `tokenizer(prompt)`)
  qwen3   Qwen3 (QK-norm, head_dim ≠ hidden/heads, tied embeddings), the prompt sent as a user
          message through the chat template (`apply_chat_template(add_generation_prompt=True)`)
Run:  python3 tools/golden_generate.py   (needs torch, transformers; tools/sft_example.sh's venv)
"""
import json
import os
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tests", "fixtures", "chat", "gen")
OUT = os.path.join(HERE, "..", "tests", "golden")
BASE = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
            hidden_act="silu", vocab_size=600)
CASES = {
    "llama": (dict(model_type="llama", tie_word_embeddings=False),
              "The streaming engine moves one layer at a time", False, 24),
    "qwen3": (dict(model_type="qwen3", head_dim=12, tie_word_embeddings=True, use_sliding_window=False),
              "Which layer is on the GPU now?", True, 20),
}


def build(case, seed):
    extra, prompt, chat, max_new = CASES[case]
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = AutoConfig.for_model(**{**BASE, **extra}, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p))
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tok(prompt)["input_ids"]
    ids = [int(i) for i in ids]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             output_scores=True, return_dict_in_generate=True)
    new = [int(t) for t in out.sequences[0, len(ids):]]
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return model, tok, cfg, dict(prompt=prompt, chat=chat, max_new_tokens=max_new, prompt_ids=ids,
                                 tokens=new, margins=margins)


def main():
    for case in CASES:
        for seed in range(100):
            model, tok, cfg, exp = build(case, seed)
            if min(exp["margins"]) >= 0.05 and len(set(exp["tokens"])) > 3:
                break
        else:
            raise SystemExit(f"{case}: no seed gave clear margins")
        d = os.path.join(OUT, f"generate_{case}")
        shutil.rmtree(d, ignore_errors=True)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(os.path.join(d, "model"), safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(TOKENIZER, f), os.path.join(d, "model", f))
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(dict(exp, seed=seed), f, indent=1)
            f.write("\n")
        print(case, "seed", seed, "prompt", len(exp["prompt_ids"]), "new", len(exp["tokens"]),
              "min margin %.3f" % min(exp["margins"]))


if __name__ == "__main__":
    main()
