"""PyTorch scaled_dot_product_attention on a dense f16 cache: the outside peer for
scripts/gpu-check.sh. Llama-3.1-8B decode shape (32 q heads, 8 KV heads, head_dim 128),
the contexts and batch sizes of carry/gpu_compare. Timing data is random (SDPA's cost does
not depend on the values); writes $OUT/sdpa.json (fields of gpu_compare's JSON lines).

--check DIR: DIR from `gpu_compare --dump-dir DIR` (its smallest context, batch 1, the
structured data): SDPA runs on exactly that cache and query, and its relative L2 error
against gpu_compare's dense kernel goes into that row's rel_error_vs_full (f16 SDPA, the
timed one) and check_error (SDPA in f32 on the same f16 data)."""
import argparse, json, os, sys
import torch

KV, QH, D = 8, 32, 128


def counts(s):
    return [int(x) for x in s.split(",") if x]


def sdpa(q, k, v):
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        g = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def check(dirname):
    """(context, rel error of f16 SDPA, rel error of f32 SDPA) against the dumped dense result."""
    meta = json.load(open(os.path.join(dirname, "meta.json")))
    n = meta["context"]

    def load(name, dtype, shape):
        raw = bytearray(open(os.path.join(dirname, name), "rb").read())
        return torch.frombuffer(raw, dtype=dtype).reshape(shape).cuda()

    k = load("k.f16", torch.float16, (n, KV, D)).permute(1, 0, 2).unsqueeze(0).contiguous()
    v = load("v.f16", torch.float16, (n, KV, D)).permute(1, 0, 2).unsqueeze(0).contiguous()
    q = load("q.f32", torch.float32, (QH, D)).reshape(1, QH, 1, D)
    want = load("full.f32", torch.float32, (QH, D)).double()

    def rel(out):
        out = out.reshape(QH, D).double()
        return float((out - want).norm() / want.norm())

    e16 = rel(sdpa(q.half(), k, v).float())
    e32 = rel(sdpa(q, k.float(), v.float()))
    return n, e16, e32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=counts, default=[32768, 131072, 524288, 1048576])
    ap.add_argument("--batch", type=counts, default=[1, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check", default=None)
    ap.add_argument("--max-gib", type=float, default=60.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sdpa_peer: torch sees no CUDA device")
    dev = torch.cuda.get_device_name()
    chk = None
    if a.check and os.path.exists(os.path.join(a.check, "meta.json")):
        chk = check(a.check)
        print(f"check: f16 SDPA vs gpu_compare full at {chk[0]} tokens: rel L2 {chk[1]:.2e} (f32 SDPA: {chk[2]:.2e})")
    out = []
    for batch in a.batch:
        for n in a.contexts:
            by = batch * n * KV * D * 2 * 2
            if by > a.max_gib * 2**30:
                print(f"skip ctx={n} b={batch}: {by / 2**30:.0f} GiB > --max-gib")
                continue
            k = torch.randn(batch, KV, n, D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            q = torch.randn(batch, QH, 1, D, device="cuda", dtype=torch.float16)
            for _ in range(a.warmup):
                sdpa(q, k, v)
            torch.cuda.synchronize()
            ts = []
            for _ in range(a.steps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); sdpa(q, k, v); e.record(); torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) * 1000)
            ts.sort(); med = ts[len(ts) // 2]
            e16 = e32 = None
            if chk and chk[0] == n and batch == 1:
                e16, e32 = chk[1], chk[2]
            out.append(dict(method="torch_sdpa", context=n, batch=batch, median_us=med, bytes_read=by,
                            gbps=by / med / 1e3, bandwidth_fraction=None, kv_bytes_per_token=4 * KV * D,
                            speedup_vs_full=None, speedup_vs_quest=None, rel_error_vs_full=e16,
                            check_error=e32, steps=a.steps, device=dev,
                            torch=torch.__version__))
            del k, v
            torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sdpa.json"), "w"), indent=1)
    for r in out:
        print(f"{r['method']:>12} ctx={r['context']:>8} b={r['batch']} {r['median_us']:9.1f} us {r['gbps']:7.0f} GB/s")


if __name__ == "__main__":
    main()
