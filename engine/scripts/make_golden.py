#!/usr/bin/env python3
"""Writes a golden fixture with an independent implementation (llama.cpp).

Usage:  python3 -m pip install llama-cpp-python jinja2
        python3 engine/scripts/make_golden.py [smollm2-135m | qwen2.5-1.5b] [MODEL.gguf]

smollm2-135m (default) writes engine/tests/fixtures/golden.json from
$MOSAICKV_HOME/SmolLM2-135M-Instruct.Q4_1.gguf (default ~/.cache/mosaickv), which
`mosaickv_engine::model_path(None)` fetches; qwen2.5-1.5b writes
engine/tests/fixtures/golden_qwen.json from Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
(`mosaickv_engine::QWEN25_CODER_1_5B.path()`). For each prompt the fixture records
the token ids (llama.cpp tokenizer, special tokens parsed, no BOS, as the GGUF asks), the
greedy continuation (up to 16 tokens, stopping after an end-of-sequence token) and the
top-5 logits at the last prompt position. Chat prompts are rendered with the GGUF's own
tokenizer.chat_template through jinja2, independently of the Rust code.
"""
import hashlib
import json
import os
import sys

import jinja2
import numpy as np
from llama_cpp import Llama, __version__ as llama_cpp_version

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
N_NEW = 16
EOS_NAMES = ("<|im_end|>", "<|endoftext|>")


def haystack(n=9):
    filler = [
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        "Rivers run to the sea, and the sea does not fill up. Clouds drift over the quiet hills.",
        "A farmer counted his sheep at dusk, then went inside to light the fire and read a book.",
    ]
    parts = []
    for i in range(n):
        parts.append(filler[i % 3])
        if i == n // 2:
            parts.append("The special magic number for the blue door is: 4729.")
    ctx = " ".join(parts)
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n" + ctx +
        "\nWhat is the special magic number for the blue door mentioned in the provided text?"
    )


PROMPTS = [
    {"name": "raw_france", "mode": "raw", "prompt": "The capital of France is Paris. The capital of Germany is"},
    {"name": "chat_math", "mode": "chat", "prompt": "In 2024, Alice had 12 apples and bought 7 more. How many apples does she have now?"},
    {"name": "chat_needle", "mode": "chat", "prompt": haystack()},
]

# Qwen2.5-Coder: short raw and chat prompts (digits one by one, code, punctuation runs,
# newlines and indentation for the qwen2 split), and a needle prompt of about 430 tokens.
PROMPTS_QWEN = [
    {"name": "raw_france", "mode": "raw", "prompt": "The capital of France is Paris. The capital of Germany is"},
    {"name": "raw_digits", "mode": "raw", "prompt": "In 2024, 12345 + 678 = 13023; isn't that right?\n\n  Yes --"},
    {"name": "chat_math", "mode": "chat", "prompt": "In 2024, Alice had 12 apples and bought 7 more. How many apples does she have now?"},
    {"name": "chat_code", "mode": "chat", "prompt": "Write a Python function `square(x)` that returns x * x."},
    {"name": "chat_needle_long", "mode": "chat", "prompt": haystack(21)},
]

MODELS = {
    "smollm2-135m": ("SmolLM2-135M-Instruct.Q4_1.gguf", "golden.json", PROMPTS),
    "qwen2.5-1.5b": ("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "golden_qwen.json", PROMPTS_QWEN),
}


def last_logits(llm):
    """Logits of the last evaluated token (llama-cpp-python >= 0.3 no longer fills llm.scores
    unless logits_all=True)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float32).copy()


def main():
    home = os.environ.get("MOSAICKV_HOME") or os.path.expanduser("~/.cache/mosaickv")
    args = sys.argv[1:]
    name = args.pop(0) if args and args[0] in MODELS else "smollm2-135m"
    file_name, out_name, prompts = MODELS[name]
    path = args[0] if args else os.path.join(home, file_name)
    out_path = os.path.join(FIXTURES, out_name)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=2, verbose=False, seed=0)
    template = jinja2.Template(llm.metadata["tokenizer.chat_template"])
    eos = [llm.tokenize(n.encode(), add_bos=False, special=True)[0] for n in EOS_NAMES]
    cases = []
    for p in prompts:
        if p["mode"] == "chat":
            text = template.render(messages=[{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
        else:
            text = p["prompt"]
        toks = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(toks)
        logits = last_logits(llm)
        top = np.argsort(-logits, kind="stable")[:5]
        gen = []
        cur = logits
        while len(gen) < N_NEW:
            nxt = int(np.argmax(cur))
            gen.append(nxt)
            if nxt in eos or len(gen) == N_NEW:
                break
            llm.eval([nxt])
            cur = last_logits(llm)
        cases.append({
            "name": p["name"],
            "mode": p["mode"],
            "prompt": p["prompt"],
            "text": text,
            "tokens": [int(t) for t in toks],
            "top5_ids": [int(i) for i in top],
            "top5_logits": [float(logits[i]) for i in top],
            "greedy": gen,
            "greedy_text": llm.detokenize(gen).decode("utf-8", "replace"),
        })
        print(p["name"], len(toks), "tokens ->", repr(cases[-1]["greedy_text"]), file=sys.stderr)
    out = {
        "generator": "engine/scripts/make_golden.py",
        "model": name,
        "llama_cpp_python": llama_cpp_version,
        "model_sha256": sha,
        "eos_ids": eos,
        "cases": cases,
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", os.path.normpath(out_path), file=sys.stderr)


if __name__ == "__main__":
    main()
