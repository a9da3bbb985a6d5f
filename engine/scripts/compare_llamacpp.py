#!/usr/bin/env python3
"""Prefill and decode speed of our engine vs llama.cpp, same GGUF, same prompts, one run.

Usage:  python3 -m pip install llama-cpp-python numpy
        cargo build --release -p mosaickv-engine --example bench
        python3 engine/scripts/compare_llamacpp.py [--lengths 1024,3072,6144] [--steps 32]
            [--methods full,mosaic] [--threads 2] [--json FILE] [--model GGUF|qwen2.5-1.5b]
            [--llama-kv f16,q8_0,q4_0] [--store-prefills] [--bench-b OTHER_BENCH --label-b NAME]

The prompts are the first N tokens of a fixed filler text, tokenized by our engine
(`bench --tokens-only`; the golden test checks that our tokenizer agrees with llama.cpp's), so
both engines see exactly the same token ids. For each length:

* llama.cpp (llama-cpp-python, n_ctx 8192 or the longest prompt plus --steps, n_threads and n_threads_batch = --threads,
  n_batch 512): `eval(prompt)` timed as prefill, then --steps greedy `eval([token])` steps timed
  as decode, with each KV-cache type of --llama-kv (default f16, llama.cpp's default cache type).
  Every type runs with flash attention on, as llama.cpp's own default (`-fa auto`) does on a CPU
  and as a quantized V cache requires; `f16-nofa` is llama-cpp-python's default (flash
  attention off), the f16 setting of this script's runs before 2026-12-05. Quantized K/V are
  Hadamard-rotated by llama.cpp 0.3.36 unless LLAMA_ATTN_ROT_DISABLE is set (`attn_rot`).
* ours: the `bench` example (one process per method, JSON lines on stdout): prefill, then
  --steps greedy decode steps on the method's cache; `fill_s` (the method compressing the
  prompt's K/V) is reported apart from prefill. With --store-prefills, the first method computes
  (and times) each prompt's prefill and stores it; the next ones read it (16K-32K, issue 38).
* KV part of a decode step: ours is timed inside the cache. llama.cpp's is not timed apart;
  when the run includes a length of at most 1,024 tokens, the table estimates it as the decode
  ms at n minus the decode ms at that shortest length, same cache type.

Engines run one after the other, never at the same time, interleaved per length and repeat;
the fastest of --repeat runs is reported. This machine is shared: before each run the script
waits (up to --quiet-wait seconds) until the CPUs are at least 80 % idle, and records the idle
fraction it saw. llama.cpp's OpenMP threads spin at barriers by default. On an idle machine
that is its fastest setting (Qwen at 16K, 2026-12-05: f16 cache without flash attention 143 ms
per token with the default policy, 166 ms with OMP_WAIT_POLICY=passive), so the script leaves
the variable unset (llama.cpp as users run it). When other processes compete for the 2 cores,
spinning collapses its speed (measured at load ~5: decode 5 tok/s with the default policy,
18-23 tok/s with passive): `--omp-wait-policy passive` is for such a machine, and every record
says which policy ran (`args.omp_wait_policy`).
With --bench-b, a second build of our `bench` (another commit, say) runs each method right
after the first, in the same interleaving: rows `ours / METHOD` and `ours (NAME) / METHOD`,
a before/after comparison that shares its llama.cpp runs and its machine state.
Prints a Markdown table; --json writes every record (llama.cpp's records carry its
`llama_print_system_info()`: the CPU features its build uses).

AMX: on an Intel Xeon with AMX, a llama-cpp-python built natively (the pip default) uses
ggml's AMX matmul, which crashed with SIGSEGV in `ggml_backend_amx_mul_mat` on the project's
2-vCPU Xeon VM (2026-12-03, llama-cpp-python 0.3.36). Build it without AMX, keeping every
AVX-512 path and the weight repacking:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF" python3 -m pip install --no-cache-dir llama-cpp-python==0.3.36
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


# --model NAME as the engine knows them (engine/src/fetch.rs); anything else is a GGUF path
KNOWN = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
}


def model_file(name):
    home = os.environ.get("MOSAICKV_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mosaickv")
    return os.path.join(home, KNOWN[name]) if name in KNOWN else name


def default_model():
    return model_file("smollm2-135m")


def cpu_idle(seconds=1.0):
    """Fraction of CPU time idle over the next `seconds` (from /proc/stat; None elsewhere)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
        return (i1 - i0) / max(1, t1 - t0)
    except OSError:
        return None


def wait_quiet(max_wait):
    """Waits until the CPUs are >= 80 % idle or `max_wait` seconds pass; returns the last idle
    fraction seen."""
    deadline = time.time() + max_wait
    while True:
        idle = cpu_idle()
        if idle is None or idle >= 0.8 or time.time() >= deadline:
            return idle
        time.sleep(2)


def run_bench(bench, args, extra, lengths=None):
    lengths = lengths or args.lengths
    cmd = [bench, "--model", args.model, "--lengths", ",".join(map(str, lengths)), "--steps", str(args.steps)] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]


# llama.cpp KV-cache types (--llama-kv): ggml type id and bytes per element (q8_0: 34 bytes per
# block of 32, q4_0: 18)
# `f16` runs with flash attention on, which is what llama.cpp's own default (`flash_attn_type`
# AUTO, `-fa auto` in llama-cli and llama-server) resolves to on a CPU; `f16-nofa` is
# llama-cpp-python's default (flash_attn=False), the setting of this script's runs before
# 2026-12-05.
KV_TYPES = {"f16": (1, 2.0), "f16-nofa": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}


def llama_n_ctx(args):
    """llama.cpp's context: 8,192 tokens as in every earlier run, or the longest prompt plus its
    decode steps when that is more (16K and 32K runs, issue 38)."""
    return max(8192, max(args.lengths) + args.steps + 16)


def load_llama(args, kv="f16"):
    """llama.cpp with its default f16 KV cache, or a quantized one (type_k = type_v; llama.cpp
    needs flash attention for a quantized V cache, so it is on for those). Quantized K/V are
    stored Hadamard-rotated by llama.cpp itself since 2026-04 unless LLAMA_ATTN_ROT_DISABLE is
    set; the script records which (`attn_rot` in each record)."""
    from llama_cpp import Llama

    extra = {"flash_attn": kv != "f16-nofa"}
    if kv not in ("f16", "f16-nofa"):
        extra.update(type_k=KV_TYPES[kv][0], type_v=KV_TYPES[kv][0])
    return Llama(
        model_path=args.model,
        n_ctx=llama_n_ctx(args),
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
        **extra,
    )


def kv_elems_per_token(llm):
    """K and V elements per token over all layers, from the GGUF header."""
    md = llm.metadata
    a = md["general.architecture"]
    layers = int(md[f"{a}.block_count"])
    kv_heads = int(md[f"{a}.attention.head_count_kv"])
    head_dim = int(md.get(f"{a}.attention.key_length") or
                   int(md[f"{a}.embedding_length"]) // int(md[f"{a}.attention.head_count"]))
    return 2 * layers * kv_heads * head_dim


def model_shape(llm):
    """(layers, kv_heads, head_dim) from the GGUF header."""
    md = llm.metadata
    a = md["general.architecture"]
    head_dim = int(md.get(f"{a}.attention.key_length") or
                   int(md[f"{a}.embedding_length"]) // int(md[f"{a}.attention.head_count"]))
    return int(md[f"{a}.block_count"]), int(md[f"{a}.attention.head_count_kv"]), head_dim


def llama_cpp(llm, args, n, toks, kv="f16", from_ours=None, real_state=None):
    """One llama.cpp run. `from_ours`: the path of our stored prefill of `toks`; llama.cpp's cache
    is then written from it (engine/scripts/llama_kv_transplant.py) instead of llama.cpp
    prefilling, and `prefill_s` is the time to load it plus llama.cpp's evaluation of the last
    prompt token."""
    import numpy as np
    from llama_cpp import __version__, llama_print_system_info
    import llama_kv_transplant as tp

    n_vocab = llm.n_vocab()
    llm.reset()
    extra = {}
    rotate = not os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    if from_ours:
        layers, _, head_dim = model_shape(llm)
        header, kvs = tp.read_prefill(from_ours)
        if header["tokens"] != n or header["layers"] != layers:
            raise SystemExit(f"{from_ours}: {header['tokens']} tokens x {header['layers']} layers, expected {n} x {layers}")
        t = time.perf_counter()
        blob = tp.build_state(llm.state_header, kv, kvs, head_dim, n - 1, rotate, v_trans=(kv == "f16-nofa"))
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        tp.load_state(llm, blob, n - 1, toks)
        llm.eval(toks[n - 1:])
        prefill_s = time.perf_counter() - t
        extra = {"cache_from": f"ours: {os.path.basename(from_ours)} (n-1 positions), llama.cpp evaluated the last prompt token",
                 "build_s": build_s}
        if real_state is not None:
            # the transplanted cache against llama.cpp's own, per layer (relative RMS difference)
            diff = tp.compare_states(kv, blob, real_state)
            extra["rel_rms_diff_vs_llama"] = {k: diff[k] for k in ("k0", "v0", f"k{layers - 1}", f"v{layers - 1}")}
            extra["rel_rms_diff_vs_llama_max"] = max(diff.values())
    else:
        t = time.perf_counter()
        llm.eval(toks)
        prefill_s = time.perf_counter() - t
        if args.llama_cache_from == "both":
            extra["state"] = tp.seq_state(llm)
    gen = []
    t = time.perf_counter()
    for _ in range(args.steps):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        gen.append(tok)
        llm.eval([tok])
    decode_s = time.perf_counter() - t
    rec = {
        "engine": "llama.cpp",
        "kv": kv,
        "kv_bytes": n * kv_elems_per_token(llm) * KV_TYPES[kv][1],
        "version": __version__,
        "n_ctx": llm.n_ctx(),
        "attn_rot": "n/a (f16 cache)" if kv.startswith("f16")
        else ("off (LLAMA_ATTN_ROT_DISABLE set)" if os.environ.get("LLAMA_ATTN_ROT_DISABLE")
              else "on (llama.cpp's default for a quantized K/V cache)"),
        "flash_attn": kv != "f16-nofa",
        "system_info": llama_print_system_info().decode(errors="replace").strip(),
        "length": n,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": args.steps / decode_s,
        "decode_ms": 1e3 * decode_s / args.steps,
        "generated": gen,
        "cache_from": "llama.cpp's own prefill",
    }
    rec.update(extra)
    print(f"llama.cpp/{kv} {n}{' (cache from ours)' if from_ours else ''}: prefill {prefill_s:.2f} s, "
          f"decode {args.steps / decode_s:.1f} tok/s", file=sys.stderr)
    return rec


def best(recs):
    """The fastest of repeated runs (the machine is shared: slower runs met other work)."""
    out = dict(min(recs, key=lambda r: r["prefill_s"]))
    fastest_decode = min(recs, key=lambda r: r["decode_s"])
    for k in ("decode_s", "decode_tok_s", "decode_ms", "decode_kv_ms"):
        if k in fastest_decode:
            out[k] = fastest_decode[k]
    out["runs"] = len(recs)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,3072,6144")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--methods", default="full,mosaic")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--bench", default=os.path.join(ROOT, "target", "release", "examples", "bench"))
    ap.add_argument("--bench-b", help="a second build of the bench example, run after each of ours")
    ap.add_argument("--label-b", default="B", help="the name of --bench-b's rows")
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine and length; the fastest is reported")
    ap.add_argument("--quiet-wait", type=float, default=60, help="seconds to wait for idle CPUs before each run")
    ap.add_argument("--omp-wait-policy", default="",
                    help="OMP_WAIT_POLICY for llama.cpp ('' = leave unset, llama.cpp's own setting; `passive` on a "
                         "shared machine, where spinning threads collapse its speed)")
    ap.add_argument("--llama-kv", default="f16",
                    help="llama.cpp KV-cache types to run, comma-separated (f16, q8_0, q4_0)")
    ap.add_argument("--store-prefills", action="store_true",
                    help="our side reads each prompt's dense prefill from $MOSAICKV_HOME/prefills (computed and "
                         "stored by the first method that needs it): at 16K-32K a prefill is minutes")
    ap.add_argument("--llama-cache-from", choices=["prefill", "ours", "both"], default="prefill",
                    help="prefill: llama.cpp prefills each prompt itself; ours: its cache is written from our stored "
                         "prefill of the same ids (rotated and quantized as llama.cpp does; llama_kv_transplant.py), "
                         "for 16K-32K where its prefill over a quantized cache takes hours; both: each way, one after "
                         "the other (a check of the transplant: same decode speed, layer-0 blocks)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.model = model_file(args.model)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.omp_wait_policy and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # read when llama.cpp loads
    args.omp_wait_policy = os.environ.get("OMP_WAIT_POLICY", "")
    if not os.path.exists(args.bench):
        sys.exit(f"{args.bench} not found: run cargo build --release -p mosaickv-engine --example bench")
    if args.bench_b and not os.path.exists(args.bench_b):
        sys.exit(f"--bench-b {args.bench_b} not found")
    if args.llama_cache_from != "prefill" and not args.store_prefills:
        sys.exit("--llama-cache-from ours|both needs --store-prefills (our stored prefill feeds llama.cpp's cache)")
    if not os.path.exists(args.model):
        sys.exit(f"{args.model} not found: run the engine once (it fetches the model) or pass --model")

    prompts = {r["length"]: r["tokens"] for r in run_bench(args.bench, args, ["--tokens-only"])}
    for n in args.lengths:
        assert len(prompts[n]) == n, f"prompt of {len(prompts[n])} tokens for length {n}"

    kvs = args.llama_kv.split(",")
    for kv in kvs:
        if kv not in KV_TYPES:
            sys.exit(f"--llama-kv {kv}: expected one of {sorted(KV_TYPES)}")
    llms = {kv: load_llama(args, kv) for kv in kvs}
    sources = {"prefill": [False], "ours": [True], "both": [False, True]}[args.llama_cache_from]
    if True in sources:
        import llama_kv_transplant as tp
        for llm in llms.values():
            llm.state_header = tp.state_header(llm)
    ref, ours, raw = [], [], []
    benches = [("ours", args.bench)] + ([(f"ours ({args.label_b})", args.bench_b)] if args.bench_b else [])

    def run_ours(n, runs):
        for m in filter(None, args.methods.split(",")):  # --methods '': llama.cpp only
            for engine, bench in benches:
                idle = wait_quiet(args.quiet_wait)
                (o,) = run_bench(bench, args, ["--method", m] + (["--store-prefills"] if args.store_prefills else []), [n])
                o["idle_before"] = idle
                o["engine"] = engine
                runs.setdefault(f"{engine} / {m}", []).append(o)
                print(f"{engine}/{m} {n}: prefill {o['prefill_s']:.2f} s, decode {o['decode_tok_s']:.1f} tok/s",
                      file=sys.stderr)

    # interleaved: each length, each repeat runs llama.cpp (each KV type) then each of our methods;
    # when llama.cpp's cache comes from our stored prefill, ours run first (they store it)
    for n in args.lengths:
        runs = {}
        for _ in range(args.repeat):
            if True in sources:
                run_ours(n, runs)
            for kv, llm in llms.items():
                real_state = None
                for from_ours in sources:
                    path = None
                    if from_ours:
                        layers, kv_heads, head_dim = model_shape(llm)
                        path = next((o.get("prefill_file") for v in runs.values() for o in v
                                     if o.get("prefill_file") and o["length"] == n), None) \
                            or tp.find_prefill(n, layers, kv_heads, head_dim)
                        if path is None:
                            sys.exit(f"no stored prefill of {n} tokens: run with --store-prefills and a method of ours")
                    idle = wait_quiet(args.quiet_wait)
                    r = llama_cpp(llm, args, n, prompts[n], kv, from_ours=path, real_state=real_state)
                    real_state = r.pop("state", None)
                    r["idle_before"] = idle
                    r["label"] = kv + (" (cache from ours)" if from_ours else "")
                    runs.setdefault(f"llama.cpp/{r['label']}", []).append(r)
            if True not in sources:
                run_ours(n, runs)
        raw.append(runs)
        ref.extend(best(v) for k, v in list(runs.items()) if k.startswith("llama.cpp/"))
        ours.extend(best(v) for k, v in runs.items() if not k.startswith("llama.cpp/"))

    # ratios are against llama.cpp's first KV type (f16 by default)
    by_len = {}
    for r in ref:
        by_len.setdefault(r["length"], r)  # llama.cpp's first KV type, first source
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}; "
          f"llama-cpp-python {ref[0]['version']}, n_threads {args.threads}; {args.steps} greedy decode steps; "
          f"fastest of {args.repeat} interleaved run(s); llama.cpp OMP_WAIT_POLICY={args.omp_wait_policy or 'default'}")
    print()
    first = ref[0]["label"]
    print(f"| prompt tokens | engine / KV cache | prefill s | prefill vs llama.cpp/{first} | decode tok/s | "
          f"decode ms/token (KV part) | decode vs llama.cpp/{first} | KV MiB | CPU idle before |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    idle = lambda r: "-" if r.get("idle_before") is None else f"{100 * r['idle_before']:.0f} %"
    # llama.cpp's KV part is not timed apart; with a short length in the run (<= 1024 tokens) it
    # is estimated as its decode ms at n minus its decode ms at the shortest length, same cache
    short = min(args.lengths)
    short_ms = {q["label"]: q["decode_ms"] for q in ref if q["length"] == short} if short <= 1024 else {}

    def prefill(o):
        if o.get("prefill_origin") == "stored":
            return f"stored (read {o['prefill_s']:.1f} s)", "-"
        if "build_s" in r:  # llama.cpp did not prefill: no ratio
            return f"{o['prefill_s']:.2f}", "-"
        return f"{o['prefill_s']:.2f}", f"{o['prefill_s'] / r['prefill_s']:.2f}x"

    for n in args.lengths:
        r = by_len[n]
        for q in (q for q in ref if q["length"] == n):
            est = (f" (~{q['decode_ms'] - short_ms[q['label']]:.1f})" if q["label"] in short_ms and n != short else "")
            pre = f"{q['prefill_s']:.2f}", f"{q['prefill_s'] / r['prefill_s']:.2f}x"
            if "build_s" in q:
                pre = f"from ours (load + last token {q['prefill_s']:.1f} s)", "-"
            print(f"| {n} | llama.cpp / full {q['label']} | {pre[0]} | {pre[1]} | "
                  f"{q['decode_tok_s']:.1f} | {q['decode_ms']:.1f}{est} | {q['decode_tok_s'] / r['decode_tok_s']:.2f}x | "
                  f"{q['kv_bytes'] / 2**20:.1f} | {idle(q)} |")
        for o in (o for o in ours if o["length"] == n):
            ps, pr = prefill(o)
            print(f"| {n} | {o['engine']} / {o['method']} | {ps} | {pr} | "
                  f"{o['decode_tok_s']:.1f} | {o['decode_ms']:.1f} ({o['decode_kv_ms']:.1f}) | "
                  f"{o['decode_tok_s'] / r['decode_tok_s']:.2f}x | {o['kv_bytes'] / 2**20:.1f} | {idle(o)} |")
    if short_ms:
        print()
        print(f"llama.cpp's KV part (~) is its decode ms at that length minus its decode ms at {short} tokens, "
              "same cache type; ours (in parentheses) is timed inside the cache.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"llama_cpp": ref, "ours": ours, "runs": raw, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
