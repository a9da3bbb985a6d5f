"""Decode speed of vLLM's CPU build with and without the MosaicKV plugin, side by side.

    python bindings/vllm/tests/bench.py --model DIR --tokens 8152 --batch 1,8 --json out.json

For each batch size and setting (MOSAICKV_VLLM=off: vLLM's own CPU attention; =mosaic: the
plugin's default), in a fresh process: `batch` prompts of `tokens` random-word tokens each
(different per sequence; prefix caching off), added to vLLM's engine at once and generated
greedily (`ignore_eos`) for 2 + `steps` tokens, stepping the engine by hand: every step after
all sequences have their first token is one decode step of the whole batch; the median of
those (less the first) is reported, with min and max.
Settings alternate per batch size, so a slow phase of the machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def worker(args) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 3][:5000]
    prompts = []
    for b in range(args.batch_size):
        rng = random.Random(1000 + b)
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(args.tokens)))[: args.tokens]
        prompts.append({"prompt_token_ids": ids})
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.tokens + args.steps + 8,
              enforce_eager=True, enable_prefix_caching=False, max_num_seqs=args.batch_size,
              seed=0)
    # Steps of the engine, timed one by one: once every sequence has its first token (its
    # prefill done), every later step is one decode step of the whole batch.
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=2 + args.steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    started, decode = set(), []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        all_started = len(started) == len(prompts)
        for o in outs:
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
        if all_started:
            decode.append(dt)
    # peak (VmHWM) and current (VmRSS, after the last step) resident memory of this process
    # and of vLLM's engine processes, while they are still alive
    peak, now = {}, {}
    import psutil

    for proc in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                st = {l.split(":")[0]: l for l in f}
            name = f"{proc.pid} {proc.name()}"
            peak[name] = int(st["VmHWM"].split()[1]) * 1024
            now[name] = int(st["VmRSS"].split()[1]) * 1024
        except (OSError, KeyError, psutil.Error):
            pass
    decode = decode[1:]  # the first decode step of a process pays one-time costs
    decode.sort()
    step = decode[len(decode) // 2]
    print("RESULT " + json.dumps({"decode_steps": len(decode), "step_s": step,
                                   "min_s": decode[0], "max_s": decode[-1],
                                   "peak_rss_bytes": peak, "rss_bytes": now}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=8152)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--settings", default="off,mosaic")
    ap.add_argument("--kv-space", default="4", help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--batch-size", type=int)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    rows = []
    for bi, b in enumerate(int(x) for x in args.batch.split(",")):
        settings = args.settings.split(",")
        if bi % 2:
            settings = settings[::-1]
        for s in settings:
            env = dict(os.environ, **ENV, MOSAICKV_VLLM=s, VLLM_CPU_KVCACHE_SPACE=args.kv_space)
            p = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model,
                                "--dtype", args.dtype, "--tokens", str(args.tokens), "--steps",
                                str(args.steps), "--batch-size", str(b)],
                               env=env, capture_output=True, text=True)
            res = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not res:
                sys.stderr.write((p.stdout + p.stderr)[-4000:])
                raise SystemExit(f"batch {b}, MOSAICKV_VLLM={s}: failed (rc {p.returncode})")
            r = json.loads(res[-1][7:])
            rows.append({"batch": b, "setting": s, **r})
            big = max(r.get("peak_rss_bytes", {}).values(), default=0)
            rss = sum(r.get("rss_bytes", {}).values())
            print(f"batch {b} {s:>7}: {1000 * r['step_s']:8.1f} ms per decode step, median of "
                  f"{r['decode_steps']} (min {1000 * r['min_s']:.1f}, max {1000 * r['max_s']:.1f}); "
                  f"largest process peak RSS {big / 2**30:.2f} GiB, all processes' RSS after "
                  f"the last step {rss / 2**30:.2f} GiB", flush=True)
    for b in sorted({r["batch"] for r in rows}):
        t = {r["setting"]: r["step_s"] for r in rows if r["batch"] == b}
        if "off" in t and "mosaic" in t:
            print(f"batch {b}: mosaic / vLLM = {t['mosaic'] / t['off']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "steps": args.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
