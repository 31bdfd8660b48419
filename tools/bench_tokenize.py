#!/usr/bin/env python3
"""Tokenization speed of `megatrain prepare` on a Parquet dataset against the `tokenizers`
Python package's batch encoding of the same file on the same threads.

  python3 tools/bench_tokenize.py OUT_DIR [--mb 100] [--threads 2] [--megatrain target/release/megatrain]

Makes (once, in OUT_DIR): a byte-level BPE tokenizer (up to 32k tokens; 19k on this corpus) trained by the `tokenizers`
package on this repository's text (GPT-2's recipe: what most hub tokenizers are), and a Parquet
file of about --mb MB of documents (paragraphs of this repository's text, shuffled, with a
counter so no two are equal) in row groups of 10,000 rows, as `datasets` writes them. Then runs,
alternating, best of three each:
  python     pyarrow reads each row group's `text` column, `Tokenizer.encode_batch(texts,
             add_special_tokens=False)` (and `encode_batch_fast` where it exists), the EOS
             appended, the ids counted — RAYON_NUM_THREADS=--threads
  megatrain  `megatrain prepare --input FILE --out OUT_DIR/tokens.bin` end to end (reading,
             tokenizing, writing u16 tokens) — RAYON_NUM_THREADS=--threads
and prints tokens/s of each and their ratio. Needs tools/setup-data-venv.sh's python.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def repo_paragraphs():
    paras = []
    for base, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in ("target", ".git", "tests")]
        for f in files:
            if f.endswith((".rs", ".md", ".py", ".sh")):
                with open(os.path.join(base, f), encoding="utf-8", errors="replace") as fh:
                    paras += [p for p in fh.read().split("\n\n") if p.strip()]
    return paras


def make(out, mb):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok_dir = os.path.join(out, "tokenizer")
    data = os.path.join(out, "data.parquet")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")) and os.path.exists(data):
        return tok_dir, data
    os.makedirs(tok_dir, exist_ok=True)
    paras = repo_paragraphs()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(paras, trainer)
    tk.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    rng = random.Random(0)
    docs, size, i = [], 0, 0
    while size < mb * 1_000_000:
        k = rng.randint(1, 6)
        d = f"[{i}] " + "\n\n".join(rng.choice(paras) for _ in range(k))
        docs.append(d)
        size += len(d.encode())
        i += 1
    pq.write_table(pa.table({"text": docs}), data, row_group_size=10_000)
    return tok_dir, data


def python_run(tok_dir, data, fast):
    from tokenizers import Tokenizer
    import pyarrow.parquet as pq

    tk = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tk.token_to_id("<|endoftext|>")
    f = pq.ParquetFile(data)
    n = 0
    t0 = time.perf_counter()
    for g in range(f.num_row_groups):
        texts = f.read_row_group(g, columns=["text"]).column("text").to_pylist()
        enc = (tk.encode_batch_fast if fast else tk.encode_batch)(texts, add_special_tokens=False)
        for e in enc:
            ids = e.ids
            ids.append(eos)
            n += len(ids)
    return n, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--megatrain", default=os.path.join(ROOT, "target", "release", "megatrain"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    tok_dir, data = make(a.out, a.mb)
    from tokenizers import Tokenizer
    has_fast = hasattr(Tokenizer, "encode_batch_fast")
    best = {}
    for _ in range(a.reps):
        for name in ["python", "python_fast", "megatrain"]:
            if name == "python_fast" and not has_fast:
                continue
            if name == "megatrain":
                out = os.path.join(a.out, "tokens.bin")
                t0 = time.perf_counter()
                r = subprocess.run([a.megatrain, "prepare", "--tokenizer", tok_dir, "--input", data,
                                    "--out", out], capture_output=True, text=True)
                secs = time.perf_counter() - t0
                if r.returncode != 0:
                    sys.exit(r.stderr)
                n = os.path.getsize(out) // 2
            else:
                n, secs = python_run(tok_dir, data, name == "python_fast")
            rate = n / secs
            if rate > best.get(name, (0, 0))[0]:
                best[name] = (rate, n)
    size = os.path.getsize(data) / 1e6
    print(f"{size:.0f} MB Parquet, {a.threads} threads, best of {a.reps}:")
    for name, (rate, n) in best.items():
        print(f"  {name:<12} {n} tokens  {rate / 1e6:6.2f} M tokens/s")
    for ref in ["python", "python_fast"]:
        if ref in best:
            print(f"  megatrain / {ref}: {best['megatrain'][0] / best[ref][0]:.2f}x")
    if best["megatrain"][1] != best["python"][1]:
        sys.exit(f"token counts differ: {best['megatrain'][1]} vs {best['python'][1]}")


if __name__ == "__main__":
    main()
