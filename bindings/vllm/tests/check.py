"""End-to-end check of the MosaicKV plugin in vLLM's CPU build (docs/VLLM.md, "Tests").

    python bindings/vllm/tests/check.py --model DIR [--dtype float32] [--json out.json]

DIR is a Hugging Face model directory (scripts/vllm-check.sh converts the project's GGUF).
Runs vLLM once per setting, each in its own process (MOSAICKV_VLLM=off: vLLM's own CPU
attention; =full: the plugin with MosaicKV's dense cache; =mosaic: the shipped default), on the
same prompts with greedy decoding, and checks:
1. the plugin is active (vLLM's log names the MosaicKV backend) and every setting answers;
2. lossless: `full` through the plugin gives vLLM's own greedy tokens on every prompt;
   a fourth request repeats the needle prompt's haystack after the first three finished, so
   vLLM's prefix cache serves its first blocks and the plugin rebuilds the sequence's cache
   from vLLM's pages (the lossless check covers it);
3. the default: reports, per prompt, whether `mosaic` gives vLLM's own greedy tokens, and the
   needle prompt's answer;
4. with --mosaickv BIN (the project's CLI) and the GGUF the model was converted from:
   `mosaickv generate` with `full` and `mosaic` on the same prompts, text against vLLM's.
Exit status 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def prompts() -> list[tuple[str, str | None]]:
    """Chat prompts, with the answer to check where there is one: two short questions and a
    needle in about 1,500 tokens of filler (past the 256-token budget floor, so MosaicKV's
    token selection is active)."""
    rng = random.Random(7)
    words = "the grass is green the sky is blue the sun is yellow here we go there and back again".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(110)]
    needle = "The special magic number for quiet-lake is: 4718093."
    lines.insert(61, needle)
    haystack = " ".join(lines)
    return [
        ("What is the capital of France? Answer in one word.", "Paris"),
        ("Write one sentence about the sea.", None),
        (haystack + "\nWhat is the special magic number for quiet-lake mentioned in the text above?", "4718093"),
    ]


def followup() -> str:
    """The needle prompt's haystack with another question (a prefix-cache hit)."""
    return prompts()[2][0].rsplit("\n", 1)[0] + "\nWhich number is given for quiet-lake? Reply with the number."


def worker(model: str, dtype: str, max_tokens: int, batched_tokens: int | None = None) -> None:
    from vllm import LLM, SamplingParams

    t = time.time()
    extra = {} if batched_tokens is None else {"max_num_batched_tokens": batched_tokens}
    llm = LLM(model=model, dtype=dtype, max_model_len=4096, enforce_eager=True, seed=0, **extra)
    load = time.time() - t
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CPU_ATTN.get_path()
    t = time.time()
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p, _ in prompts()],
        SamplingParams(temperature=0, max_tokens=max_tokens),
    )
    # A second request sharing the needle prompt's haystack: vLLM's prefix cache serves its
    # first blocks, so the plugin rebuilds that sequence's cache from vLLM's pages.
    again = llm.chat([{"role": "user", "content": followup()}],
                     SamplingParams(temperature=0, max_tokens=max_tokens))
    outs = list(outs) + list(again)
    print("RESULT " + json.dumps({
        "load_s": load,
        "cpu_attn_backend": backend,
        "generate_s": time.time() - t,
        "texts": [o.outputs[0].text for o in outs],
        "ids": [list(o.outputs[0].token_ids) for o in outs],
    }), flush=True)


def run(setting: str, args) -> dict:
    env = dict(os.environ, **ENV, MOSAICKV_VLLM=setting)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run(
        [sys.executable, __file__, "--worker", "--model", args.model, "--dtype", args.dtype,
         "--max-tokens", str(args.max_tokens)]
        + ([] if args.batched_tokens is None else ["--batched-tokens", str(args.batched_tokens)]),
        env=env, capture_output=True, text=True, timeout=args.timeout,
    )
    log = p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.stderr.write(log[-4000:])
        raise SystemExit(f"vLLM with MOSAICKV_VLLM={setting} failed (rc {p.returncode})")
    r = json.loads(lines[-1][len("RESULT "):])
    r["plugin_active"] = r["cpu_attn_backend"] == "mosaickv_vllm.backend.MosaicKVBackend"
    r["kv_cache_line"] = next((l.strip() for l in log.splitlines() if "KV cache size" in l), None)
    # how the plugin keyed the steps' rows (request id from the runner, or first block)
    r["rows_keyed_by"] = sorted(set(re.findall(r"rows keyed by (request id|first block)", log)))
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json")
    ap.add_argument("--mosaickv", help="the mosaickv binary, to compare with `mosaickv generate`")
    ap.add_argument("--gguf", help="the GGUF --model of `mosaickv generate` (default: smollm2-135m)",
                    default="smollm2-135m")
    ap.add_argument("--batched-tokens", type=int,
                    help="vLLM's max_num_batched_tokens: below a prompt's length, the prompt "
                         "comes in chunks (vLLM's CPU default is 4,096 for LLM)")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.dtype, args.max_tokens, args.batched_tokens)
        return 0
    res = {s: run(s, args) for s in ("off", "full", "mosaic")}
    ok = True
    report = {"model": args.model, "dtype": args.dtype, "batched_tokens": args.batched_tokens,
              "settings": res, "checks": {}}
    for s in ("off", "full", "mosaic"):
        if res[s]["plugin_active"] != (s != "off"):
            print(f"FAIL: MOSAICKV_VLLM={s}: vLLM's CPU_ATTN is {res[s]['cpu_attn_backend']}")
            ok = False
        if s != "off":
            keyed = res[s]["rows_keyed_by"]
            print(f"MOSAICKV_VLLM={s}: rows keyed by {keyed}")
            if "request id" not in keyed:
                print(f"FAIL: MOSAICKV_VLLM={s}: the runner's request ids never reached the backend")
                ok = False
    same_full = [a == b for a, b in zip(res["off"]["ids"], res["full"]["ids"])]
    same_mosaic = [a == b for a, b in zip(res["off"]["ids"], res["mosaic"]["ids"])]
    report["checks"] = {"full_equals_vllm": same_full, "mosaic_equals_vllm": same_mosaic}
    print(f"full (lossless) == vLLM's own greedy tokens: {same_full}")
    print(f"mosaic (default) == vLLM's own greedy tokens: {same_mosaic}")
    for (p, ans), i in zip(prompts() + [(followup(), "4718093")], range(4)):
        for s in ("off", "full", "mosaic"):
            t = res[s]["texts"][i]
            hit = "" if ans is None else (" [answer found]" if ans in t else " [answer MISSING]")
            print(f"  prompt {i} {s:>6}: {t!r}{hit}")
    if args.mosaickv:
        gen = {}
        for m in ("full", "mosaic"):
            gen[m] = []
            for p, _ in prompts():
                r = subprocess.run([args.mosaickv, "generate", "--model", args.gguf, "--method", m,
                                    "--max-tokens", str(args.max_tokens), "--prompt", p],
                                   capture_output=True, text=True, timeout=args.timeout)
                if r.returncode != 0:
                    raise SystemExit(f"mosaickv generate --method {m} failed: {r.stderr[-2000:]}")
                gen[m].append(r.stdout.strip())
        report["mosaickv_generate"] = gen
        for m, vm in (("full", "off"), ("mosaic", "mosaic")):
            same = [g == v.strip() for g, v in zip(gen[m], res[vm]["texts"])]
            report["checks"][f"generate_{m}_equals_vllm_{vm}"] = same
            print(f"mosaickv generate --method {m} == vLLM ({vm}) text: {same}")
            for i, (g, v) in enumerate(zip(gen[m], res[vm]["texts"])):
                if g != v.strip():
                    print(f"  prompt {i}: mosaickv {g!r}\n            vLLM     {v.strip()!r}")
    if not all(same_full):
        print("FAIL: the lossless setting changed vLLM's greedy tokens")
        ok = False
    for s in ("off", "full", "mosaic"):
        print(f"{s:>6}: load {res[s]['load_s']:.1f} s, generate {res[s]['generate_s']:.1f} s; {res[s]['kv_cache_line']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
