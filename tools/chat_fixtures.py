#!/usr/bin/env python3
"""Chat-template fixtures for megatrain's SFT data path, computed by Hugging Face transformers.

  python3 tools/chat_fixtures.py        (needs torch, transformers, tokenizers; re-runnable)

Writes under tests/fixtures/chat/:
  gen/tokenizer.json, gen/tokenizer_config.json
      the byte-level BPE tokenizer of tools/sft_example.py (rebuilt here, deterministically), whose
      ChatML template marks each assistant turn's content + <|im_end|> with {% generation %}
  qwen/tokenizer.json, qwen/tokenizer_config.json
      the same tokenizer with Qwen2.5-Instruct's chat template (no generation blocks; default
      system message, tools branch), verbatim from Qwen/Qwen2.5-0.5B-Instruct's tokenizer_config.json
  conversations.jsonl      6 conversations {"messages": [...]}: with and without system, multi-turn,
                           trailing space / newline in assistant content, non-ASCII text
  expected_gen.json, expected_qwen.json
      one object per conversation, in order: {"text", "input_ids", "assistant_masks"}
      gen:  tok.apply_chat_template(messages, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True); "text" is the rendered chat
      qwen: no generation blocks, so the mask comes from rendered prefixes: for each assistant
            message k, the span [len(render(messages[:k], add_generation_prompt=True)),
            len(render(messages[:k+1]))) of the full text render(messages); the tokens from
            char_to_token(start) to char_to_token(end - 1) inclusive are 1 (transformers' own
            convention for generation blocks). Spans are in characters (Unicode code points).
The chat template is written inline into tokenizer_config.json (as on most Hub models), not into
the chat_template.jinja file that transformers 5 writes by default.
"""
import json
import os
import sys
import tempfile

from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sft_example import conversations, train_tokenizer  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "chat")

# Qwen/Qwen2.5-0.5B-Instruct, tokenizer_config.json "chat_template" (revision 7ae5576), verbatim.
QWEN25_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [msg("user", "What is 2 plus 3?"), msg("assistant", "2 plus 3 is 5.")],
    [msg("system", "You are a helpful math tutor."), msg("user", "What is 7 times 6?"),
     msg("assistant", "7 times 6 is 42."), msg("user", "And 9 minus 4?"), msg("assistant", "9 minus 4 is 5.")],
    [msg("user", "Say something short."), msg("assistant", "Sure. ")],
    [msg("system", "Answer on two lines."), msg("user", "List 1 and 2."), msg("assistant", "1\n2\n")],
    [msg("user", "Is café ≥ 2? 😀"), msg("assistant", "Yes: café ≥ 2 — naïve ✓ 😀")],
    [msg("system", "Be terse."), msg("user", "What is 1 plus 1?"), msg("assistant", " 2"),
     msg("user", "assistant\nuser"), msg("assistant", "  Odd <b>input</b>  \n\n"),
     msg("user", "Thanks!"), msg("assistant", "You're welcome.")],
]


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


def save_tokenizers():
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(conversations()).save_pretrained(tmp, save_jinja_files=False)
        tokenizer_json = open(os.path.join(tmp, "tokenizer.json"), encoding="utf-8").read()
        config = json.load(open(os.path.join(tmp, "tokenizer_config.json"), encoding="utf-8"))
    for name, template in (("gen", config["chat_template"]), ("qwen", QWEN25_TEMPLATE)):
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
        with open(os.path.join(OUT, name, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
        write_json(os.path.join(OUT, name, "tokenizer_config.json"), {**config, "chat_template": template})


def expected_gen(tok, messages):
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return {"text": tok.apply_chat_template(messages, tokenize=False), "input_ids": list(out["input_ids"]),
            "assistant_masks": list(out["assistant_masks"])}


def expected_by_prefixes(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(enc["input_ids"])
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        assert text.startswith(prompt) and text.startswith(upto), "template is not prefix-stable"
        start, end = len(prompt), len(upto)
        span = range(enc.char_to_token(start), enc.char_to_token(end - 1) + 1)
        # the same as "every token with a character in [start, end)" for this tokenizer
        assert list(span) == [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
        for t in span:
            mask[t] = 1
    return {"text": text, "input_ids": enc["input_ids"], "assistant_masks": mask}


def main():
    save_tokenizers()
    with open(os.path.join(OUT, "conversations.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS)
    gen = AutoTokenizer.from_pretrained(os.path.join(OUT, "gen"))
    qwen = AutoTokenizer.from_pretrained(os.path.join(OUT, "qwen"))
    assert qwen.chat_template == QWEN25_TEMPLATE and "endgeneration" not in qwen.chat_template
    gen_expected = [expected_gen(gen, c) for c in CONVERSATIONS]
    # cross-check: on the gen template, prefix rendering gives transformers' mask but for the "\n"
    # after each assistant <|im_end|>, which the prefix span includes and the generation block not
    for c, e in zip(CONVERSATIONS, gen_expected):
        p = expected_by_prefixes(gen, c)
        assert p["input_ids"] == e["input_ids"]
        assert all(pm >= em for pm, em in zip(p["assistant_masks"], e["assistant_masks"]))
    write_json(os.path.join(OUT, "expected_gen.json"), gen_expected)
    write_json(os.path.join(OUT, "expected_qwen.json"), [expected_by_prefixes(qwen, c) for c in CONVERSATIONS])
    print(f"wrote {os.path.normpath(OUT)}: gen/, qwen/, conversations.jsonl, expected_gen.json, expected_qwen.json")


if __name__ == "__main__":
    main()
