"""Attention against numpy's exact softmax, lossless MosaicKV against full, and
the reference backend against the CPU one."""

import numpy as np
import pytest

import mosaickv
from conftest import covariance_bytes, exact_attention, low_rank_kv, queries, rel_l2, rows_memory

# conformance/src/tolerances.rs ATTEND_REL_L2: the bound between the optimized and
# the reference attention on the same cache.
ATTEND_REL_L2 = 1e-5
# Rounding K/V to f16 moves each element by <= 2^-11 relative; attention outputs move
# by about that much (measured here: ~3e-4); 2e-3 leaves room, and a method that
# drops anything (tokens, channels) is off by far more (see test_lossy_is_not_full).
F16_REL = 2e-3


def f16_round(a):
    return a.astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("tokens,kv_heads,q_heads,head_dim", [(1, 1, 1, 8), (33, 2, 4, 16), (300, 2, 6, 64)])
def test_full_equals_numpy_exact_attention(backend, tokens, kv_heads, q_heads, head_dim):
    k, v = low_rank_kv(1, tokens, kv_heads, head_dim)
    q = queries(2, q_heads, head_dim)
    cache = mosaickv.FullCache(kv_heads, head_dim, backend=backend)
    cache.prefill(k, v)
    out = cache.attend(q)
    assert out.dtype == np.float32 and out.shape == (q_heads, head_dim)
    # Exact on the K/V the cache stores (f16): only float arithmetic differs.
    assert rel_l2(out, exact_attention(f16_round(k), f16_round(v), q)) < ATTEND_REL_L2
    # And within f16 rounding of the unrounded inputs.
    assert rel_l2(out, exact_attention(k, v, q)) < F16_REL


def lossless():
    """Every channel, every token, no truncation (SPEC 2 keys)."""
    return mosaickv.Config(
        token_rate=1.0,
        channels={"mode": "fixed", "retention": 1.0, "group_size": 1},
        truncate_fraction=0.0,
        input_segment_len=128,
    )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_lossless_mosaic_equals_full(backend):
    kv_heads, q_heads, d = 2, 4, 32
    k, v = low_rank_kv(3, 500, kv_heads, d)
    q = queries(4, q_heads, d)
    mosaic = mosaickv.Cache(kv_heads, d, lossless(), backend=backend)
    full = mosaickv.FullCache(kv_heads, d, backend=backend)
    for c in (mosaic, full):
        c.prefill(k, v)
    # Generated tokens too: buffer flushes and a generated segment (SPEC 10.2).
    k2, v2 = low_rank_kv(5, 70, kv_heads, d)
    for t in range(70):
        for c in (mosaic, full):
            c.append(k2[t], v2[t])
    assert len(mosaic) == len(full) == 570
    assert all(h.key.r == d and h.value.r == d for s in mosaic.segments for h in s.heads)
    # Lossless up to the f16 rounding of the rotated values (SPEC 5-6).
    assert rel_l2(mosaic.attend(q), full.attend(q)) < F16_REL


def test_lossy_is_not_full():
    """The tolerance above can fail: the paper's setting (25 % channels, 10 % tokens) is far off."""
    kv_heads, d = 2, 32
    k, v = low_rank_kv(3, 500, kv_heads, d)
    q = queries(4, 4, d)
    mosaic = mosaickv.Cache(kv_heads, d, mosaickv.Config.paper())
    full = mosaickv.FullCache(kv_heads, d)
    mosaic.prefill(k, v)
    full.prefill(k, v)
    assert rel_l2(mosaic.attend(q), full.attend(q)) > 10 * F16_REL


@pytest.mark.parametrize("config", [mosaickv.Config(), mosaickv.Config.paper(), mosaickv.Config(input_segment_len=96, min_segment_len=128, buffer_capacity=64)])
def test_reference_agrees_with_cpu(config):
    kv_heads, q_heads, d = 2, 8, 64
    k, v = low_rank_kv(7, 400, kv_heads, d)
    caches = {b: mosaickv.Cache(kv_heads, d, config, backend=b) for b in ("cpu", "reference")}
    k2, v2 = low_rank_kv(8, 150, kv_heads, d)
    for c in caches.values():
        c.prefill(k, v)
        for t in range(150):
            c.append(k2[t], v2[t])
    cpu, ref = caches["cpu"], caches["reference"]
    # Same strategies (SPEC 5-7 are exact across backends) and the same bytes.
    assert cpu.segments == ref.segments
    assert rows_memory(cpu.memory()) == rows_memory(ref.memory())
    # every byte: the CPU cache's covariance accumulators while a segment is open
    open_seg = cpu.segments[-1].state == "open" if cpu.segments else False
    assert cpu.memory()["host_scratch"] == (covariance_bytes(kv_heads, d) if open_seg else 0)
    assert ref.memory()["host_scratch"] == 0
    assert cpu.memory()["host_bytes"] == cpu.memory()["host_rows"] + cpu.memory()["host_scratch"]
    for seed in range(3):
        q = queries(10 + seed, q_heads, d)
        assert rel_l2(cpu.attend(q), ref.attend(q)) < ATTEND_REL_L2


@pytest.mark.parametrize("make", [
    lambda: mosaickv.Cache(2, 16),
    lambda: mosaickv.Cache(2, 16, backend="reference"),
    lambda: mosaickv.FullCache(2, 16),
    lambda: mosaickv.QuestCache(2, 16),
    lambda: mosaickv.Naive2dCache(2, 16),
])
def test_q_heads_come_with_the_queries(make):
    """Any multiple of kv_heads, changing from call to call (GQA, SPEC 1)."""
    k, v = low_rank_kv(11, 200, 2, 16)
    cache = make()
    cache.prefill(k, v)
    first = {g: cache.attend(queries(20 + g, 2 * g, 16)) for g in (1, 2, 4)}
    for g in (4, 1, 2):
        np.testing.assert_array_equal(cache.attend(queries(20 + g, 2 * g, 16)), first[g])
    # A group of 2 is not two groups of 1: query heads 0 and 1 both read KV head 0.
    q = queries(30, 4, 16)
    full = mosaickv.FullCache(2, 16)
    full.prefill(k, v)
    expect = exact_attention(f16_round(k), f16_round(v), q)
    assert rel_l2(full.attend(q), expect) < ATTEND_REL_L2


def test_float16_input_equals_its_float32_widening():
    k, v = low_rank_kv(12, 150, 2, 16)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    q = queries(13, 4, 16)
    a, b = mosaickv.Cache(2, 16), mosaickv.Cache(2, 16)
    a.prefill(k16, v16)
    b.prefill(k16.astype(np.float32), v16.astype(np.float32))
    np.testing.assert_array_equal(a.attend(q.astype(np.float16)), b.attend(q.astype(np.float16).astype(np.float32)))


def test_non_contiguous_inputs_are_read_correctly():
    k, v = low_rank_kv(14, 150, 2, 16)
    q = queries(15, 4, 16)
    a, b = mosaickv.Cache(2, 16), mosaickv.Cache(2, 16)
    a.prefill(k, v)
    # Fortran order and a strided view hold the same values.
    kf = np.asfortranarray(k)
    vs = np.empty((150, 2, 32), np.float32)
    vs[:, :, ::2] = v
    b.prefill(kf, vs[:, :, ::2])
    np.testing.assert_array_equal(a.attend(q), b.attend(np.asfortranarray(q)))
    assert a.segments == b.segments


def test_memory_counts_every_kind():
    cache = mosaickv.Cache(2, 16)
    k, v = low_rank_kv(16, 200, 2, 16)
    cache.prefill(k, v)
    cache.append(k[0], v[0])
    m = cache.memory()
    kinds = ["values", "bitmaps", "padding", "block_meta", "rotations", "dense", "segment_headers"]
    assert m["device_bytes"] == sum(m[x] for x in kinds)
    assert m["tokens"] == len(cache) == 201
    assert m["dense_f16_bytes_per_token"] == 4 * 2 * 16
    assert m["bytes_per_token"] == pytest.approx(m["device_bytes"] / 201)
    assert m["host_rows"] == 4 * 2 * (2 * 16)  # the one buffered token's f32 K and V
    # SPEC 13: rotations are f16 D x kept_dims, K and V, per segment and head.
    assert m["rotations"] == sum(2 * 16 * (h.key.kept_dims + h.value.kept_dims) for s in cache.segments for h in s.heads)
