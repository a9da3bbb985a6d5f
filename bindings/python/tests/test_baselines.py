"""The baselines' save/load (SPEC sections 15.5-15.6) and the kvq8 / kvq4 caches
(SPEC section 12) checked against numpy: ggml's q8_0 / q4_0 blocks decoded here from
their documented layout, exact softmax attention over them."""

import struct

import numpy as np
import pytest

import mosaickv
from conftest import FIXTURES, low_rank_kv, queries, rel_l2, run_cli

KV, D = 2, 32

MAKERS = {
    ("full", "cpu"): lambda: mosaickv.FullCache(KV, D),
    ("full", "reference"): lambda: mosaickv.FullCache(KV, D, backend="reference"),
    ("quest", "cpu"): lambda: mosaickv.QuestCache(KV, D, token_rate=0.2),
    ("quest", "reference"): lambda: mosaickv.QuestCache(KV, D, token_rate=0.2, backend="reference"),
    ("naive2d", "reference"): lambda: mosaickv.Naive2dCache(KV, D, token_rate=0.2, retention=0.25),
    ("kvq8", "cpu"): lambda: mosaickv.Kvq8Cache(KV, D),
    ("kvq8", "reference"): lambda: mosaickv.Kvq8Cache(KV, D, backend="reference"),
    ("kvq4", "cpu"): lambda: mosaickv.Kvq4Cache(KV, D),
    ("kvq4", "reference"): lambda: mosaickv.Kvq4Cache(KV, D, backend="reference"),
}
CLASSES = {
    "full": mosaickv.FullCache,
    "quest": mosaickv.QuestCache,
    "naive2d": mosaickv.Naive2dCache,
    "kvq8": mosaickv.Kvq8Cache,
    "kvq4": mosaickv.Kvq4Cache,
}


def grow(cache, seed, n):
    k, v = low_rank_kv(seed, n, KV, D)
    for t in range(n):
        cache.append(k[t], v[t])


def filled(key, prompt=300, generated=37):
    cache = MAKERS[key]()
    k, v = low_rank_kv(10, prompt, KV, D)
    cache.prefill(k, v)
    grow(cache, 11, generated)
    return cache


@pytest.mark.parametrize("key", sorted(MAKERS), ids="-".join)
def test_save_load_round_trip(tmp_path, key):
    method, backend = key
    cache = filled(key)
    path = tmp_path / f"{method}.mkv"
    cache.save(path)
    back = CLASSES[method].load(path, backend=backend)
    assert type(back) is type(cache) and back.backend == backend
    assert len(back) == len(cache) == 337
    assert back.memory() == cache.memory()
    q = queries(12, 2 * KV, D)
    np.testing.assert_array_equal(back.attend(q), cache.attend(q))
    # It goes on growing exactly like the original (naive2d keeps the prompt's masks).
    grow(back, 13, 20)
    grow(cache, 13, 20)
    assert back.memory() == cache.memory()
    np.testing.assert_array_equal(back.attend(q), cache.attend(q))
    # Saving again gives the same bytes.
    cache.save(tmp_path / "a.mkv")
    back.save(tmp_path / "b.mkv")
    assert (tmp_path / "a.mkv").read_bytes() == (tmp_path / "b.mkv").read_bytes()
    # An empty cache saves and loads as an empty cache.
    MAKERS[key]().save(tmp_path / "empty.mkv")
    empty = CLASSES[method].load(tmp_path / "empty.mkv", backend=backend)
    assert len(empty) == 0
    with pytest.raises(mosaickv.EmptyCacheError):
        empty.attend(q)


@pytest.mark.parametrize("method", ["full", "quest", "kvq8", "kvq4"])
def test_cpu_and_reference_write_the_same_file(tmp_path, method):
    for backend in ("cpu", "reference"):
        filled((method, backend)).save(tmp_path / f"{backend}.mkv")
    assert (tmp_path / "cpu.mkv").read_bytes() == (tmp_path / "reference.mkv").read_bytes()


def saved_files(tmp_path):
    """One file of each kind: a compressed cache and every baseline's."""
    files = {}
    for method in CLASSES:
        files[method] = tmp_path / f"{method}.mkv"
        filled((method, "reference"), prompt=50, generated=3).save(files[method])
    files["cache"] = tmp_path / "cache.mkv"
    c = mosaickv.Cache(KV, D)
    c.prefill(*low_rank_kv(14, 50, KV, D))
    c.save(files["cache"])
    return files


FOUND = {
    "cache": "a compressed cache (cache.mkv)",
    "full": "a full baseline file (dense.mkv)",
    "quest": "a quest baseline file (dense.mkv, token_rate 0.2)",
    "naive2d": "a naive2d baseline file (token_rate 0.2, retention 0.25)",
    "kvq8": "a kvq8 baseline file",
    "kvq4": "a kvq4 baseline file",
}


def test_a_file_of_another_kind_is_an_oserror_naming_what_it_found(tmp_path):
    files = saved_files(tmp_path)
    loaders = dict(CLASSES, cache=mosaickv.Cache)
    for kind, path in files.items():
        for name, cls in loaders.items():
            backend = "reference" if name == "naive2d" else "cpu"
            if name == kind:
                assert len(cls.load(path, backend=backend)) == 53 - 3 * (kind == "cache")
                continue
            with pytest.raises(mosaickv.BadFormatError) as e:
                cls.load(path, backend=backend)
            assert isinstance(e.value, OSError)
            msg = str(e.value)
            assert FOUND[kind] in msg and str(path) in msg, (kind, name, msg)


def test_full_loads_the_dense_file_of_mosaickv_compress(cli, tmp_path):
    rc, _, err = run_cli(cli, "compress", "--keys", FIXTURES / "keys_f16.npy", "--values", FIXTURES / "values_f32.npy", "--out", tmp_path / "c")
    assert rc == 0, err
    k, v, q = (np.load(FIXTURES / n) for n in ("keys_f16.npy", "values_f32.npy", "queries_f32.npy"))
    direct = mosaickv.FullCache(k.shape[1], k.shape[2])
    direct.prefill(k, v)
    loaded = mosaickv.FullCache.load(tmp_path / "c" / "dense.mkv")
    np.testing.assert_array_equal(loaded.attend(q), direct.attend(q))
    with pytest.raises(mosaickv.BadFormatError, match="no baseline recorded"):
        mosaickv.QuestCache.load(tmp_path / "c" / "dense.mkv")
    # And the CLI reads a saved full cache's file as its dense.mkv.
    direct.save(tmp_path / "c" / "dense.mkv")
    rc, _, err = run_cli(cli, "attend", "--cache", tmp_path / "c", "--queries", FIXTURES / "queries_f32.npy",
                         "--method", "full", "--out", tmp_path / "o.npy")
    assert rc == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), direct.attend(q))


@pytest.mark.parametrize("method", sorted(CLASSES))
def test_corrupt_baseline_files(tmp_path, method):
    backend = "reference" if method == "naive2d" else "cpu"
    saved = tmp_path / "ok.mkv"
    filled((method, backend), prompt=40, generated=2).save(saved)
    data = saved.read_bytes()
    cases = {
        "magic": b"NOTMOSAI" + data[8:],
        "truncated": data[: len(data) - 5],
        "trailing": data + b"\0",
        "flipped": data[:70] + bytes([data[70] ^ 1]) + data[71:],
        "empty": b"",
    }
    for name, bytes_ in cases.items():
        p = tmp_path / f"{name}.mkv"
        p.write_bytes(bytes_)
        with pytest.raises(mosaickv.BadFormatError) as e:
            CLASSES[method].load(p, backend=backend)
        assert str(p) in str(e.value), name
    with pytest.raises(mosaickv.IoError, match="missing.mkv"):
        CLASSES[method].load(tmp_path / "missing.mkv", backend=backend)
    with pytest.raises(mosaickv.IoError):
        MAKERS[(method, backend)]().save(tmp_path / "no" / "such" / "dir.mkv")


def test_baseline_load_backends():
    # naive 2-D has only the reference implementation: backend="cpu" runs it and says so
    # (as `mosaickv attend` and the engine do), so a missing file is the error here
    with pytest.raises(mosaickv.IoError):
        mosaickv.Naive2dCache.load("x.mkv", backend="cpu")
    assert mosaickv.Naive2dCache(2, 16, backend="cpu").backend == "reference"
    with pytest.raises(mosaickv.BackendUnavailableError):
        mosaickv.Kvq8Cache.load("x.mkv", backend="cuda")
    with pytest.raises(mosaickv.InvalidConfigError, match="unknown backend `gpu`"):
        mosaickv.QuestCache.load("x.mkv", backend="gpu")


# ------------------------------------------------------------------ kvq8 / kvq4 against numpy

BLOCK = 32


def ggml_roundf(x):
    """C's roundf on float32: half away from zero."""
    a = np.abs(x)
    r = np.floor(a)
    r = r + (a - r >= np.float32(0.5))
    return np.copysign(r, x)


def quantize_q8_0(x):
    """ggml's quantize_row_q8_0_ref on rows of 32, float32 arithmetic: (f16 scales, int8 quants)."""
    x = np.asarray(x, np.float32).reshape(-1, BLOCK)
    d = np.max(np.abs(x), axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = ggml_roundf(x * inv[:, None]).astype(np.int8)
    return d.astype(np.float16), q


def quantize_q4_0(x):
    """ggml's quantize_row_q4_0_ref: `max` the first element of largest |x|, d = max / -8,
    q = min(15, trunc(x / d + 8.5)); (f16 scales, quants 0..15)."""
    x = np.asarray(x, np.float32).reshape(-1, BLOCK)
    mx = x[np.arange(len(x)), np.argmax(np.abs(x), axis=1)]
    d = mx / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.minimum(15, np.trunc(x * inv[:, None] + np.float32(8.5))).astype(np.uint8)
    return d.astype(np.float16), q


def parse_kvq_file(path, bits):
    """The key and value blocks of a kvq file (SPEC section 15.6), decoded from the documented
    layout: 24-byte header, then sections (kind u32, crc u32, length u64, payload); the
    blocks section (kind 21) is tokens u64, key blocks, value blocks; a block is an f16
    scale then 32 int8 (q8_0) or 16 bytes of nibbles, element j low, j + 16 high (q4_0).
    Returns (scales, signed quants) per side, [tokens * kv_heads * blocks_per_head] blocks."""
    data = path.read_bytes()
    assert data[:8] == b"MOSAICKV"
    (count,) = struct.unpack_from("<I", data, 12)
    pos, sections = 24, {}
    for _ in range(count):
        kind, _crc, length = struct.unpack_from("<IIQ", data, pos)
        sections[kind] = data[pos + 16 : pos + 16 + length]
        pos += 16 + length
    payload = sections[21]
    (tokens,) = struct.unpack_from("<Q", payload, 0)
    bb = 34 if bits == 8 else 18
    n = tokens * KV * D // BLOCK
    out = []
    for side in range(2):
        raw = np.frombuffer(payload, np.uint8, n * bb, 8 + side * n * bb).reshape(n, bb)
        scale = raw[:, :2].copy().view("<f2")[:, 0]
        if bits == 8:
            q = raw[:, 2:].view(np.int8).astype(np.int32)
        else:
            q = np.concatenate([(raw[:, 2:] & 0x0F), (raw[:, 2:] >> 4)], axis=1).astype(np.int32) - 8
        out.append((scale, q))
    return tokens, out


def dequantize(scale, q, tokens):
    """x = q * d, [tokens, kv_heads, D]."""
    return (q * scale.astype(np.float32)[:, None]).astype(np.float32).reshape(tokens, KV, D)


def exact_attention_f64(k, v, q, kv=KV, d=D):
    k, v, q = (np.asarray(a, np.float64) for a in (k, v, q))
    group = q.shape[0] // kv
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        z = k[:, h // group] @ q[h] / np.sqrt(d)
        p = np.exp(z - z.max())
        out[h] = (p / p.sum()) @ v[:, h // group]
    return out


# The Rust attention is f32 throughout (ggml's row: integer block sums, f32 logits, an online
# softmax in f32, f32 value accumulation over every token); numpy's is f64 on the same
# dequantized values. Each f32 operation errs by at most 2^-24 relatively; over 337 tokens and
# 32 dims the accumulated bound is a few 1e-6 relative, so 2e-5 is f32 rounding with margin
# and far below the q8_0 error of the query itself (about 2e-2 on these arrays, checked below;
# the measured f32 gap is about 1e-6).
F32_ROUNDING = 2e-5


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_kvq_equals_exact_attention_over_the_dequantized_blocks(tmp_path, bits, backend):
    cache = filled((f"kvq{bits}", backend))
    k, v = low_rank_kv(10, 300, KV, D)
    k2, v2 = low_rank_kv(11, 37, KV, D)
    k, v = np.concatenate([k, k2]), np.concatenate([v, v2])
    # The blocks the cache stores are ggml's quantizer's, computed here independently.
    cache.save(tmp_path / "c.mkv")
    tokens, [(ks, kq), (vs, vq)] = parse_kvq_file(tmp_path / "c.mkv", bits)
    assert tokens == 337
    quant = quantize_q8_0 if bits == 8 else quantize_q4_0
    for (scale, qs), x in [((ks, kq), k), ((vs, vq), v)]:
        d, q = quant(x)
        np.testing.assert_array_equal(scale.view(np.uint16), d.view(np.uint16))
        np.testing.assert_array_equal(qs, q.astype(np.int32) - (8 if bits == 4 else 0))
    kd, vd = dequantize(ks, kq, tokens), dequantize(vs, vq, tokens)
    q = queries(12, 2 * KV, D)
    # ggml quantizes the query to q8_0 too (the vec_dot_type of both formats).
    qd_scale, qd_q = quantize_q8_0(q)
    q8 = (qd_q.astype(np.float32) * qd_scale.astype(np.float32)[:, None]).reshape(q.shape)
    out = cache.attend(q)
    assert out.dtype == np.float32
    expect = exact_attention_f64(kd, vd, q8)
    assert rel_l2(out, expect) < F32_ROUNDING
    np.testing.assert_allclose(out, expect, rtol=0, atol=F32_ROUNDING * np.abs(expect).max())
    # Without the query's own quantization the gap is the q8_0 error, far above f32 rounding.
    assert rel_l2(out, exact_attention_f64(kd, vd, q)) > 10 * F32_ROUNDING


@pytest.mark.parametrize("bits,block_bytes", [(8, 34), (4, 18)])
def test_kvq_memory_is_ggml_bytes(bits, block_bytes):
    for backend in ("cpu", "reference"):
        cache = filled((f"kvq{bits}", backend))
        m = cache.memory()
        blocks = 2 * len(cache) * KV * D // BLOCK  # K and V
        assert m["device_bytes"] == blocks * block_bytes
        assert m["values"] == blocks * (block_bytes - 2) and m["block_meta"] == blocks * 2
        assert m["tokens"] == 337
        assert all(m[k] == 0 for k in ("bitmaps", "padding", "rotations", "dense", "segment_headers", "host_rows"))
        assert m["bytes_per_token"] == pytest.approx(2 * KV * D / BLOCK * block_bytes)


@pytest.mark.parametrize("bits", [8, 4])
def test_kvq_reference_and_cpu_agree(bits):
    cpu, ref = filled((f"kvq{bits}", "cpu")), filled((f"kvq{bits}", "reference"))
    # The conformance tolerance of kvq is exact: the optimized loop runs the reference's f32
    # operations in the same order (conformance/tests/kvq.rs).
    for seed in range(5):
        q = queries(20 + seed, 4 * KV, D)
        np.testing.assert_array_equal(cpu.attend(q), ref.attend(q))


# ------------------------------------------------------------------ kvq errors


KVQ = [(f"kvq{b}", backend) for b in (8, 4) for backend in ("cpu", "reference")]


@pytest.fixture(params=KVQ, ids="-".join)
def kvq(request):
    cache = filled(request.param, prompt=100, generated=5)
    q = queries(30, 2 * KV, D)
    return request.param, cache, q, cache.attend(q)


def unchanged(cache, q, before):
    assert len(cache) == 105
    np.testing.assert_array_equal(cache.attend(q), before)


def test_kvq_bad_input_is_refused_and_the_cache_kept(kvq):
    (method, _), cache, q, before = kvq
    k = np.ones((KV, D), np.float32)
    nan = k.copy(); nan[1, 2] = np.nan
    inf = k.copy(); inf[0, 0] = -np.inf
    big = k.copy(); big[0, 0] = 1e7 if method == "kvq8" else 6e5  # block scale beyond f16
    for args, exc in [
        ((k.astype(np.float64), k), mosaickv.DtypeError),
        ((k, k.tolist()), mosaickv.DtypeError),
        ((k[0], k), mosaickv.ShapeMismatchError),
        ((np.ones((KV, D + 32), np.float32), k), mosaickv.ShapeMismatchError),
        ((nan, k), mosaickv.NonFiniteError),
        ((k, inf), mosaickv.NonFiniteError),
        ((big, k), mosaickv.NonFiniteError),
        ((k, big), mosaickv.NonFiniteError),
    ]:
        with pytest.raises(exc):
            cache.append(*args)
        unchanged(cache, q, before)
    bad_q = q.copy(); bad_q[1, 3] = np.nan
    big_q = q.copy(); big_q[0, 0] = 1e7  # its q8_0 scale is beyond f16
    for args, exc in [
        (q.astype(np.float64), mosaickv.DtypeError),
        (q[:, :-1], mosaickv.ShapeMismatchError),
        (q[:3], mosaickv.GqaMismatchError),
        (bad_q, mosaickv.NonFiniteError),
        (big_q, mosaickv.NonFiniteError),
    ]:
        with pytest.raises(exc):
            cache.attend(args)
        unchanged(cache, q, before)
    with pytest.raises(mosaickv.AlreadyPrefilledError):
        cache.prefill(*low_rank_kv(31, 10, KV, D))
    unchanged(cache, q, before)


@pytest.mark.parametrize("key", KVQ, ids="-".join)
def test_kvq_bad_prefill_leaves_the_cache_empty(key):
    cache = MAKERS[key]()
    k, v = low_rank_kv(32, 64, KV, D)
    k_big = k.copy(); k_big[63, 1, 31] = 1e7
    for args, exc in [
        ((k.astype(np.int32), v), mosaickv.DtypeError),
        ((k[0], v[0]), mosaickv.ShapeMismatchError),
        ((k, v[:10]), mosaickv.ShapeMismatchError),
        ((k_big, v), mosaickv.NonFiniteError),
    ]:
        with pytest.raises(exc):
            cache.prefill(*args)
        assert len(cache) == 0
    with pytest.raises(mosaickv.EmptyCacheError):
        cache.attend(queries(33, KV, D))
    cache.prefill(k.astype(np.float16), v)  # float16 is taken (widened exactly)
    assert len(cache) == 64


def test_kvq_head_dim_must_be_a_multiple_of_32():
    for cls in (mosaickv.Kvq8Cache, mosaickv.Kvq4Cache):
        for backend in ("cpu", "reference"):
            with pytest.raises(mosaickv.InvalidConfigError, match="multiple of the block length 32"):
                cls(2, 48, backend=backend)
        with pytest.raises(mosaickv.BackendUnavailableError):
            cls(2, 32, backend="cuda")


def test_help_of_the_baselines_names_the_spec_sections():
    import pydoc

    for cls, sections in [
        (mosaickv.FullCache, ["SPEC section 12", "SPEC section 15.5"]),
        (mosaickv.QuestCache, ["SPEC section 12", "SPEC section 15.5"]),
        (mosaickv.Naive2dCache, ["SPEC section 12", "SPEC section 15.6"]),
        (mosaickv.Kvq8Cache, ["SPEC section 12", "section 15.6", "34 bytes per 32 values"]),
        (mosaickv.Kvq4Cache, ["SPEC section 12", "SPEC section 15.6", "18 bytes per 32 values"]),
    ]:
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        for s in sections + ["save", "load", "prefill", "append", "attend", "memory"]:
            assert s in text, (cls.__name__, s)


# ------------------------------------------------------------------ kvq rotated (llama.cpp today)


def sylvester_hadamard(n):
    """llama.cpp's `ggml_gen_hadamard`: H[i][j] = (-1)^popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    pop = np.vectorize(lambda x: bin(x).count("1"))(i[:, None] & i[None, :])
    return np.where(pop % 2 == 0, 1.0, -1.0) / np.sqrt(n)


def rotate(x, n):
    """Rows [..., d] rotated block-diagonally by H_n (f64)."""
    shape = x.shape
    blocks = np.asarray(x, np.float64).reshape(-1, n)
    return (blocks @ sylvester_hadamard(n).T).reshape(shape)


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_kvq_is_llama_cpps_rotation_then_ggmls_blocks(tmp_path, bits):
    """kvq8 / kvq4 as llama.cpp runs them since 2026-04: K and Q rotated by H_128 (the largest
    power of two >= 64 dividing head_dim 128), V by H_64 blocks, the output rotated back by
    H_64. Checked against this numpy model of it, built from the Hadamard matrix itself."""
    kv, d = 2, 128
    cls = mosaickv.Kvq8Cache if bits == 8 else mosaickv.Kvq4Cache
    k, v = low_rank_kv(20, 200, kv, d)
    k[:, :, 3] *= 30.0  # an outlier channel, what the rotation is for
    cache = cls(kv, d)
    cache.prefill(k, v)
    cache.save(tmp_path / "c.mkv")
    plain = cls(kv, d, rotated=False)
    plain.prefill(k, v)
    q = queries(21, 2 * kv, d)
    out = cache.attend(q)
    # the file's blocks dequantize to the rotated rows (within each format's step)
    data = (tmp_path / "c.mkv").read_bytes()
    kr, vr = rotate(k, 128), rotate(v, 64)
    quant = quantize_q8_0 if bits == 8 else quantize_q4_0
    dk, qk = quant(kr.astype(np.float32))
    dv, qv = quant(vr.astype(np.float32))
    deq = lambda dd, qq: ((qq.astype(np.float32) - (8 if bits == 4 else 0)) * dd.astype(np.float32)[:, None]).reshape(200, kv, d)
    kd, vd = deq(dk, qk), deq(dv, qv)
    assert b'"rotated":true' in data
    # attention in the rotated space on the q8_0 rotated query, rotated back by H_64
    qr = rotate(q, 128).astype(np.float32)
    qs, qq = quantize_q8_0(qr)
    q8 = (qq.astype(np.float32) * qs.astype(np.float32)[:, None]).reshape(q.shape)
    expect = rotate(exact_attention_f64(kd, vd, q8, kv, d), 64)
    assert rel_l2(out, expect) < 1e-4, rel_l2(out, expect)
    # and it differs from the unrotated cache (the rotation is not a no-op)
    assert rel_l2(plain.attend(q), out) > 1e-4
    # the saved file reads back rotated: the same output bits
    np.testing.assert_array_equal(cls.load(tmp_path / "c.mkv").attend(q), out)

