"""Compress one attention layer's K/V, attend a query, and print the error against
exact attention and the memory saved.

    python bindings/python/examples/compress_layer.py                 # the CLI's test fixtures
    python bindings/python/examples/compress_layer.py --keys K.npy --values V.npy --queries Q.npy

K and V are ``[tokens, kv_heads, head_dim]`` (keys after RoPE), Q is
``[q_heads, head_dim]``, float32 or float16 ``.npy`` files. The defaults are the
small fixtures of ``cli/tests/fixtures`` (96 tokens, 2 KV heads, 4 query heads,
head_dim 16, low-rank K/V plus noise).
"""

import argparse
from pathlib import Path

import numpy as np

import mosaickv

FIXTURES = Path(__file__).resolve().parents[3] / "cli" / "tests" / "fixtures"


def exact_attention(k, v, q):
    """softmax(q.k / sqrt(D)) v in float64, query head h reading KV head h // group."""
    k, v, q = (np.asarray(a, np.float64) for a in (k, v, q))
    group = q.shape[0] // k.shape[1]
    out = np.empty(q.shape)
    for h in range(q.shape[0]):
        z = k[:, h // group] @ q[h] / np.sqrt(k.shape[2])
        p = np.exp(z - z.max())
        out[h] = (p / p.sum()) @ v[:, h // group]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default=FIXTURES / "keys_f16.npy")
    ap.add_argument("--values", default=FIXTURES / "values_f32.npy")
    ap.add_argument("--queries", default=FIXTURES / "queries_f32.npy")
    a = ap.parse_args()
    k, v, q = np.load(a.keys), np.load(a.values), np.load(a.queries)
    tokens, kv_heads, head_dim = k.shape
    exact = exact_attention(k, v, q)
    print(f"{tokens} tokens, {kv_heads} KV heads, {q.shape[0]} query heads, head_dim {head_dim}")
    methods = {
        "mosaic (SPEC 2 defaults)": mosaickv.Cache(kv_heads, head_dim),
        "mosaic (paper setting)": mosaickv.Cache(kv_heads, head_dim, mosaickv.Config.paper()),
        "quest (20 % tokens)": mosaickv.QuestCache(kv_heads, head_dim, token_rate=0.2),
        "full (dense f16)": mosaickv.FullCache(kv_heads, head_dim),
    }
    if head_dim % 32 == 0:  # ggml's blocks hold 32 values (the fixtures' head_dim is 16)
        methods["kvq8 (llama.cpp q8_0)"] = mosaickv.Kvq8Cache(kv_heads, head_dim)
        methods["kvq4 (llama.cpp q4_0)"] = mosaickv.Kvq4Cache(kv_heads, head_dim)
    dense = 4 * kv_heads * head_dim  # bytes per token of dense f16 K and V
    for name, cache in methods.items():
        cache.prefill(k, v)
        out = cache.attend(q)
        err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        bpt = cache.memory()["bytes_per_token"]
        print(f"{name:<26} rel. error {err:.2e}   {bpt:7.1f} B/token ({100 * (1 - bpt / dense):5.1f} % saved vs dense f16)")
    seg = methods["mosaic (SPEC 2 defaults)"].segments[0]
    h = seg.heads[0]
    print(f"segment 0 (tokens {seg.start}..{seg.start + seg.len}), head 0: block {h.block_size}, "
          f"K r={h.key.r}/{h.key.kept_dims} g={h.key.g} loss {h.key.fit_loss:.4f}, "
          f"V r={h.value.r}/{h.value.kept_dims} g={h.value.g} loss {h.value.fit_loss:.4f}")


if __name__ == "__main__":
    main()
