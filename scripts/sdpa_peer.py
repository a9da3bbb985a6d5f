"""PyTorch scaled_dot_product_attention on a dense f16 cache: the outside peer for
scripts/gpu-check.sh. Llama-3.1-8B decode shape (32 q heads, 8 KV heads, head_dim 128)."""
import json, os, sys, torch
ctxs = [32768, 131072, 524288, 1048576]
out = []
for batch in (1, 8):
    for n in ctxs:
        if batch * n * 8 * 128 * 2 * 2 > 60 * 2**30:
            continue
        k = torch.randn(batch, 8, n, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.float16)
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for _ in range(3): f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1000)
        ts.sort(); med = ts[len(ts) // 2]
        by = 2 * k.numel() * 2
        out.append(dict(method="torch_sdpa", context=n, batch=batch, median_us=med, bytes_read=by,
                        gbps=by / med / 1e3, bandwidth_fraction=None, kv_bytes_per_token=4 * 8 * 128,
                        speedup_vs_full=None, speedup_vs_quest=None, rel_error_vs_full=None,
                        device=torch.cuda.get_device_name()))
        del k, v
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "sdpa.json"), "w"), indent=1)
for r in out: print(f"{r['method']:>12} ctx={r['context']:>8} b={r['batch']} {r['median_us']:9.1f} us {r['gbps']:7.0f} GB/s")
