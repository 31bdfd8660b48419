#!/usr/bin/env python3
"""A tiny, self-contained chat SFT example for megatrain (needs torch, transformers, tokenizers).

  python3 tools/sft_example.py make OUT_DIR
      OUT_DIR/model/          a tiny random LlamaForCausalLM (fp32 safetensors, hidden 64, 2 layers,
                              4 heads / 2 KV heads) with its tokenizer saved beside config.json:
                              a byte-level BPE (~600 tokens) trained on the example conversations,
                              special tokens <|begin_of_text|> (bos), <|im_start|>, <|im_end|> (eos),
                              <|pad|> (pad), and a ChatML chat template whose assistant turns
                              (content + <|im_end|>) sit in {% generation %} blocks
      OUT_DIR/chat.jsonl      400 synthetic arithmetic conversations {"messages": [...]}
      OUT_DIR/chat_val.jsonl  40 more, for validation

  python3 tools/sft_example.py generate HF_DIR "What is 2 plus 5?"
      loads the model and its tokenizer from HF_DIR (a megatrain export, which carries the
      tokenizer of the model it started from), applies the chat template with
      add_generation_prompt=True, greedily generates up to 20 tokens and prints the completion.

Everything `make` writes is deterministic (fixed seeds). For scale: in PyTorch, 400 steps of 16
conversations at lr 3e-3 (loss on assistant tokens only) teach the model the answer format
("2 plus 5 is ..."); by ~1000 steps it recites training answers, but it does not learn arithmetic.
"""
import json
import os
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, IM_START, IM_END, PAD = "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"

# ChatML. The {% generation %} block marks what the model is trained to produce: the assistant's
# content and its end-of-turn token (not the "\n" after it, which the next turn's prompt starts with).
CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

SYSTEMS = [None, None, "You are a helpful math tutor.", "Answer arithmetic questions briefly."]
OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
ASK = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "How much is {a} {op} {b}?"]
FOLLOW = ["And {a} {op} {b}?", "What about {a} {op} {b}?"]


def question(rng):
    op = rng.choice(list(OPS))
    a, b = (rng.randint(0, 12), rng.randint(0, 12)) if op == "times" else (rng.randint(0, 20), rng.randint(0, 20))
    if op == "minus" and a < b:
        a, b = b, a
    return dict(a=a, op=op, b=b), f"{a} {op} {b} is {OPS[op](a, b)}."


def conversation(rng):
    messages = []
    system = rng.choice(SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    q, answer = question(rng)
    messages += [{"role": "user", "content": rng.choice(ASK).format(**q)}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:  # a second turn
        q, answer = question(rng)
        messages += [{"role": "user", "content": rng.choice(FOLLOW).format(**q)},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


def train_tokenizer(convs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[BOS, IM_START, IM_END, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [f"{m['role']}\n{m['content']}\n" for c in convs for m in c["messages"]]
    corpus += [f"{n} is {n}." for n in range(1000)]  # enough text for ~600 tokens
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=PAD,
                                 additional_special_tokens=[IM_START])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def conversations():
    """The 440 example conversations: 400 for training, then 40 for validation."""
    rng = random.Random(1234)
    return [conversation(rng) for _ in range(440)]


def make(out):
    convs = conversations()
    os.makedirs(os.path.join(out, "model"), exist_ok=True)
    for name, part in (("chat.jsonl", convs[:400]), ("chat_val.jsonl", convs[400:])):
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(c) + "\n" for c in part)
    tok = train_tokenizer(convs)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    # save_jinja_files=False: the template goes inline into tokenizer_config.json, as on most Hub
    # models, rather than into the chat_template.jinja that transformers 5 writes by default
    tok.save_pretrained(os.path.join(out, "model"), save_jinja_files=False)
    print(f"wrote {out}/model (vocab {len(tok)}), {out}/chat.jsonl (400), {out}/chat_val.jsonl (40)")


def generate(hf_dir, prompt):
    # The export carries the tokenizer and chat template of the model it started from.
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "generate":
        generate(*sys.argv[2:])
    else:
        sys.exit(__doc__)
