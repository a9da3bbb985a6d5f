#!/usr/bin/env python3
"""kvq8 / kvq4 against llama.cpp's own quantized KV cache: the same prompts, greedy answers.

Usage:  python3 -m pip install llama-cpp-python jinja2 numpy
        cargo build --release -p mosaickv-cli
        python3 engine/scripts/kvq_crosscheck.py [--model GGUF] [--max-new 24] [--threads 2]
            [--json FILE]

For each prompt (chat prompts rendered with the GGUF's own chat template through jinja2, as
make_golden.py does, and needle-in-a-haystack prompts of about 300, 1,000 and 2,000 tokens), and
for each KV format pair

    llama.cpp type_k = type_v = f16   vs   ours --method full
    llama.cpp type_k = type_v = q8_0  vs   ours --method kvq8         (rotation on, llama.cpp's default)
    llama.cpp type_k = type_v = q4_0  vs   ours --method kvq4
    the same with LLAMA_ATTN_ROT_DISABLE=1   vs   ours --method kvq8-norot / kvq4-norot

llama.cpp (llama-cpp-python, flash_attn on: llama.cpp needs it for a quantized V cache; n_batch
512) evaluates the prompt tokens and decodes greedily up to --max-new tokens (stopping after an
end-of-sequence token); ours runs `mosaickv generate --raw` on the rendered text (the golden
test checks that both tokenizers give the same ids). The script prints, per prompt and
format, whether the two greedy texts are equal and, if not, where they first differ. The
f16 row is the control: our forward pass is not llama.cpp's bit for bit, so greedy texts can
differ there too; a quantized format matches llama.cpp as well as the control does, or not.
"""
import argparse
import json
import os
import subprocess
import sys

import jinja2
import numpy as np
from llama_cpp import Llama, __version__ as llama_cpp_version

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EOS_NAMES = ("<|im_end|>", "<|endoftext|>")
# ggml_type values (ggml.h): GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q8_0 = 8; the last
# field: llama.cpp's Hadamard rotation of a quantized cache (on by default since 2026-04, off with
# LLAMA_ATTN_ROT_DISABLE=1, read when a context is created)
FORMATS = [
    ("f16", 1, "full", True),
    ("q8_0", 8, "kvq8", True),
    ("q4_0", 2, "kvq4", True),
    ("q8_0 norot", 8, "kvq8-norot", False),
    ("q4_0 norot", 2, "kvq4-norot", False),
]


def haystack(lines, number, key):
    filler = [
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        "Rivers run to the sea, and the sea does not fill up. Clouds drift over the quiet hills.",
        "A farmer counted his sheep at dusk, then went inside to light the fire and read a book.",
    ]
    parts = []
    for i in range(lines):
        parts.append(filler[i % 3])
        if i == lines * 2 // 5:
            parts.append(f"The special magic number for {key} is: {number}.")
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n" + " ".join(parts) +
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    )


PROMPTS = [
    ("chat_math", "In 2024, Alice had 12 apples and bought 7 more. How many apples does she have now?"),
    ("chat_capital", "What is the capital of France? Answer in one sentence."),
    ("chat_poem", "Write two lines of a poem about the sea."),
    ("chat_list", "List three colours of the rainbow, separated by commas."),
    ("chat_code", "Write a Python function that returns the square of a number."),
    ("needle_300", haystack(12, 4729, "the blue door")),
    ("needle_600", haystack(26, 61904, "the green lamp")),
    ("needle_1k", haystack(45, 8316207, "the red kite")),
    ("needle_1500", haystack(70, 270418, "the silver key")),
    ("needle_2k", haystack(95, 5093421, "the old lighthouse")),
]


def last_logits(llm):
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32).copy()


def llama_greedy(llm, toks, max_new, eos):
    llm.reset()
    llm.eval(toks)
    cur = last_logits(llm)
    gen = []
    while len(gen) < max_new:
        nxt = int(np.argmax(cur))
        if nxt in eos:
            break
        gen.append(nxt)
        if len(gen) == max_new:
            break
        llm.eval([nxt])
        cur = last_logits(llm)
    return llm.detokenize(gen).decode("utf-8", "replace")


def ours(cli, model, method, text, max_new):
    cmd = [cli, "generate", "--raw", "--method", method, "--max-tokens", str(max_new), "--prompt", text]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # `generate` ends its output with one newline of its own
    return out[:-1] if out.endswith("\n") else out


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser()
    home = os.environ.get("MOSAICKV_HOME") or os.path.expanduser("~/.cache/mosaickv")
    ap.add_argument("--model", default=os.path.join(home, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cli", default=os.path.join(ROOT, "target", "release", "mosaickv"))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for fmt, ggml_type, method, rotate in FORMATS:
        if rotate:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        else:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        llm = Llama(model_path=args.model, n_ctx=4096, n_batch=512, n_threads=args.threads,
                    n_threads_batch=args.threads, type_k=ggml_type, type_v=ggml_type,
                    flash_attn=True, verbose=False, seed=0)
        template = jinja2.Template(llm.metadata["tokenizer.chat_template"])
        eos = [llm.tokenize(n.encode(), add_bos=False, special=True)[0] for n in EOS_NAMES]
        for name, prompt in PROMPTS:
            text = template.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
            toks = llm.tokenize(text.encode(), add_bos=False, special=True)
            theirs = llama_greedy(llm, toks, args.max_new, eos)
            mine = ours(args.cli, args.model, method, text, args.max_new)
            d = first_diff(theirs, mine)
            rows.append({"prompt": name, "tokens": len(toks), "format": fmt, "method": method,
                         "llama_cpp": theirs, "ours": mine, "equal": d is None, "first_diff": d})
            print(f"{name} ({len(toks)} tokens) {fmt}: {'same' if d is None else f'differ at char {d}'}"
                  f"\n  llama.cpp: {theirs!r}\n  ours:      {mine!r}", file=sys.stderr)
        del llm
    print(f"llama-cpp-python {llama_cpp_version}, {args.model}, greedy, max {args.max_new} new tokens\n")
    print("| prompt | tokens | " + " | ".join(f"{f} vs {m}" for f, _, m, _ in FORMATS) + " |")
    print("|---|---:|" + "---|" * len(FORMATS))
    for name, _ in PROMPTS:
        rs = [r for r in rows if r["prompt"] == name]
        cells = []
        for f, _, _, _ in FORMATS:
            r = next(r for r in rs if r["format"] == f)
            cells.append("same" if r["equal"] else f"differ at char {r['first_diff']}")
        print(f"| {name} | {rs[0]['tokens']} | " + " | ".join(cells) + " |")
    same = {f: sum(r["equal"] for r in rows if r["format"] == f) for f, _, _, _ in FORMATS}
    print("\nSame greedy text: " + ", ".join(f"{f} {same[f]}/{len(PROMPTS)}" for f, _, _, _ in FORMATS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"llama_cpp_python": llama_cpp_version, "model": args.model, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
