"""Every error class: the right exception, derived from the right builtin, and
nothing of the cache lost."""

import numpy as np
import pytest

import mosaickv
from conftest import low_rank_kv, queries

KV, D = 2, 16


def assert_is(exc_type, *bases):
    assert issubclass(exc_type, mosaickv.MosaicError)
    for b in bases:
        assert issubclass(exc_type, b), (exc_type, b)


def test_class_tree():
    for c in [mosaickv.NonFiniteError, mosaickv.ShapeMismatchError, mosaickv.GroupSizeNotDivisorError,
              mosaickv.RetentionOutOfRangeError, mosaickv.EmptyCacheError, mosaickv.GqaMismatchError,
              mosaickv.UnknownConfigKeyError, mosaickv.InvalidConfigError, mosaickv.AlreadyPrefilledError,
              mosaickv.DtypeError]:
        assert_is(c, ValueError)
    for c in [mosaickv.BadFormatError, mosaickv.IoError, mosaickv.CorruptPackedError]:
        assert_is(c, OSError)
    assert_is(mosaickv.BackendUnavailableError, RuntimeError)
    assert_is(mosaickv.DtypeError, TypeError)


MAKERS = {
    "cpu": lambda: mosaickv.Cache(KV, D, mosaickv.Config(input_segment_len=64)),
    "reference": lambda: mosaickv.Cache(KV, D, mosaickv.Config(input_segment_len=64), backend="reference"),
    "full": lambda: mosaickv.FullCache(KV, D),
    "quest": lambda: mosaickv.QuestCache(KV, D),
    "naive2d": lambda: mosaickv.Naive2dCache(KV, D),
}


@pytest.fixture(params=sorted(MAKERS))
def filled(request):
    """A cache with a prompt and a few generated tokens, and its answer to a fixed query."""
    cache = MAKERS[request.param]()
    k, v = low_rank_kv(50, 200, KV, D)
    cache.prefill(k, v)
    k2, v2 = low_rank_kv(51, 70, KV, D)  # past a buffer flush (capacity 64)
    for t in range(70):
        cache.append(k2[t], v2[t])
    q = queries(52, 2 * KV, D)
    return cache, q, cache.attend(q)


def unchanged(cache, q, before):
    assert len(cache) == 270
    np.testing.assert_array_equal(cache.attend(q), before)


def bad_inputs():
    k = np.ones((KV, D), np.float32)
    nan = k.copy(); nan[1, 2] = np.nan
    inf = k.copy(); inf[0, 0] = np.inf
    big = k.copy(); big[0, 0] = 7e4           # finite in f32, beyond f16 (SPEC 14)
    return [
        ("key", (k.astype(np.int64), k), mosaickv.DtypeError),
        ("key", (k.astype(np.float64), k), mosaickv.DtypeError),
        ("key", (k.tolist(), k), mosaickv.DtypeError),
        ("value", (k, "no"), mosaickv.DtypeError),
        ("key", (k[0], k), mosaickv.ShapeMismatchError),               # rank 1
        ("key", (k[None], k), mosaickv.ShapeMismatchError),            # rank 3
        ("key", (np.ones((KV + 1, D), np.float32), k), mosaickv.ShapeMismatchError),
        ("value", (k, np.ones((KV, D - 1), np.float32)), mosaickv.ShapeMismatchError),
        ("key", (nan, k), mosaickv.NonFiniteError),
        ("value", (k, inf), mosaickv.NonFiniteError),
        ("key", (big, k), mosaickv.NonFiniteError),
    ]


@pytest.mark.parametrize("what,args,exc", bad_inputs())
def test_bad_append_is_refused_and_the_cache_kept(filled, what, args, exc):
    cache, q, before = filled
    with pytest.raises(exc) as e:
        cache.append(*args)
    assert what in str(e.value)
    unchanged(cache, q, before)


def test_bad_queries_are_refused_and_the_cache_kept(filled):
    cache, q, before = filled
    bad_q = q.copy(); bad_q[0, 0] = np.nan
    for args, exc in [
        (q.astype(np.float64), mosaickv.DtypeError),
        (q[0], mosaickv.ShapeMismatchError),
        (q[:, :-1], mosaickv.ShapeMismatchError),
        (q[:3], mosaickv.GqaMismatchError),
        (q[:0], mosaickv.GqaMismatchError),
        (bad_q, mosaickv.NonFiniteError),
    ]:
        with pytest.raises(exc):
            cache.attend(args)
        unchanged(cache, q, before)


def test_second_prefill_is_refused(filled):
    cache, q, before = filled
    k, v = low_rank_kv(53, 10, KV, D)
    with pytest.raises(mosaickv.AlreadyPrefilledError, match="already holds 270 tokens"):
        cache.prefill(k, v)
    unchanged(cache, q, before)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bad_prefill_leaves_the_cache_empty_and_usable(name):
    cache = MAKERS[name]()
    k, v = low_rank_kv(54, 100, KV, D)
    k_bad = k.copy(); k_bad[99, 1, 15] = 1e5
    for args, exc in [
        ((k.astype(np.float64), v), mosaickv.DtypeError),
        ((k[0], v[0]), mosaickv.ShapeMismatchError),
        ((k, v[:50]), mosaickv.ShapeMismatchError),
        ((k_bad, v), mosaickv.NonFiniteError),
    ]:
        with pytest.raises(exc):
            cache.prefill(*args)
        assert len(cache) == 0
    with pytest.raises(mosaickv.EmptyCacheError, match="the cache is empty"):
        cache.attend(queries(55, KV, D))
    cache.prefill(k, v)
    assert len(cache) == 100


def test_config_errors():
    with pytest.raises(mosaickv.UnknownConfigKeyError, match="`tokens_rate`"):
        mosaickv.Config(tokens_rate=0.1)
    with pytest.raises(mosaickv.UnknownConfigKeyError, match="`ratio`"):
        mosaickv.Config(channels={"mode": "fixed", "retention": 0.25, "group_size": 1, "ratio": 2})
    with pytest.raises(mosaickv.InvalidConfigError, match="token_rate 1.5"):
        mosaickv.Config(token_rate=1.5)
    with pytest.raises(mosaickv.InvalidConfigError):
        mosaickv.Config(block_sizes=[32, 16])
    with pytest.raises(mosaickv.InvalidConfigError):
        mosaickv.Config(sink_tokens="four")
    with pytest.raises(mosaickv.GroupSizeNotDivisorError, match="head_dim 18 is not divisible by group size 4"):
        mosaickv.Cache(2, 18)  # the default group sizes are 1, 2, 4
    with pytest.raises(mosaickv.InvalidConfigError, match="head_dim must be positive"):
        mosaickv.Cache(2, 0)
    with pytest.raises(mosaickv.GqaMismatchError):
        mosaickv.Cache(0, 16)
    with pytest.raises(mosaickv.InvalidConfigError, match="unknown backend `gpu`"):
        mosaickv.Cache(2, 16, backend="gpu")
    with pytest.raises(mosaickv.InvalidConfigError, match="token_rate"):
        mosaickv.QuestCache(2, 16, token_rate=0.0)
    with pytest.raises(TypeError):
        mosaickv.Cache(2, 16, config={"token_rate": 0.1})


def test_config_round_trip_and_paper():
    cfg = mosaickv.Config(token_rate=0.3, block_sizes=[16, 32])
    assert cfg.token_rate == 0.3 and cfg.block_sizes == [16, 32] and cfg.sink_tokens == 4
    assert mosaickv.Config.from_json(cfg.to_json()) == cfg
    assert mosaickv.Cache(2, 16, cfg).config == cfg
    p = mosaickv.Config.paper()
    assert p.channels == {"mode": "fixed", "retention": 0.25, "group_size": 1}
    assert (p.token_rate, p.truncate_fraction, p.block_sizes) == (0.1, 0.25, [16])
    assert p != mosaickv.Config()
    assert mosaickv.Config(token_rate=np.float32(0.25), block_sizes=np.array([16, 32])).block_sizes == [16, 32]
    with pytest.raises(TypeError):
        mosaickv.Config(token_rate=object())
    with pytest.raises(AttributeError):
        cfg.token_rate = 0.5


@pytest.mark.skipif(mosaickv.has_cuda(), reason="this build has the CUDA backend")
def test_cuda_without_the_feature_is_unavailable():
    with pytest.raises(mosaickv.BackendUnavailableError, match="no CUDA support"):
        mosaickv.Cache(2, 16, backend="cuda")
    with pytest.raises(mosaickv.BackendUnavailableError):
        mosaickv.Naive2dCache(2, 16, backend="cuda")


@pytest.fixture
def saved(tmp_path):
    cache = MAKERS["cpu"]()
    k, v = low_rank_kv(56, 200, KV, D)
    cache.prefill(k, v)
    path = tmp_path / "cache.mkv"
    cache.save(path)
    return path


def test_corrupt_files(saved, tmp_path):
    data = saved.read_bytes()
    cases = {
        "magic": b"NOTMOSAI" + data[8:],
        "truncated": data[: len(data) - 5],
        "trailing": data + b"\0",
        "flipped": data[:100] + bytes([data[100] ^ 1]) + data[101:],
        "empty": b"",
    }
    for name, bytes_ in cases.items():
        p = tmp_path / f"{name}.mkv"
        p.write_bytes(bytes_)
        for backend in ("cpu", "reference"):
            with pytest.raises(mosaickv.BadFormatError) as e:
                mosaickv.Cache.load(p, backend=backend)
            assert str(p) in str(e.value), name
    with pytest.raises(mosaickv.IoError, match="missing.mkv"):
        mosaickv.Cache.load(tmp_path / "missing.mkv")
    with pytest.raises(mosaickv.IoError):
        mosaickv.Cache(2, 16).save(tmp_path / "no" / "such" / "dir.mkv")
    # OSError-derived: a caller's `except OSError` catches them.
    with pytest.raises(OSError):
        mosaickv.Cache.load(tmp_path / "truncated.mkv")


def test_every_baseline_has_save_and_load():
    # The round trips and file errors are in test_baselines.py.
    for cls in (mosaickv.FullCache, mosaickv.QuestCache, mosaickv.Naive2dCache, mosaickv.Kvq8Cache, mosaickv.Kvq4Cache):
        assert callable(cls.save) and callable(cls.load)


@pytest.mark.parametrize("make", [
    lambda kv, d: mosaickv.Cache(kv, d),
    lambda kv, d: mosaickv.FullCache(kv, d),
    lambda kv, d: mosaickv.QuestCache(kv, d),
    lambda kv, d: mosaickv.Naive2dCache(kv, d),
    lambda kv, d: mosaickv.Kvq8Cache(kv, d),
    lambda kv, d: mosaickv.Kvq4Cache(kv, d, backend="reference"),
])
def test_bad_dimensions_are_typed_errors(make):
    # Negative or oversized counts: InvalidConfigError, never PyO3's OverflowError.
    for kv, d in [(-1, 64), (2, -64), (2**64, 64), (2, 2**70)]:
        with pytest.raises(mosaickv.InvalidConfigError):
            make(kv, d)
    # Zero: the library's own rule (SPEC section 1), still a MosaicError.
    for kv, d in [(0, 64), (2, 0)]:
        with pytest.raises(mosaickv.MosaicError):
            make(kv, d)
    # numpy integers are integers.
    assert len(make(np.int64(2), np.int32(32))) == 0
    with pytest.raises(TypeError):
        make(2.0, 64)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_refused_attend_keeps_the_caches_q_heads(tmp_path, backend):
    """Queries of another q_heads that are refused (NaN) leave the cache's shape, and what
    it saves, as they were (the shape was taken before the queries were checked)."""
    k, v = low_rank_kv(0, 200, KV, D)
    c = mosaickv.Cache(KV, D, mosaickv.Config(input_segment_len=64), backend=backend)
    c.prefill(k, v)
    q = queries(1, 2 * KV, D)
    before = c.attend(q)
    c.save(str(tmp_path / "a"))
    bad = queries(2, 4 * KV, D)
    bad[1, 3] = np.nan
    with pytest.raises(mosaickv.NonFiniteError):
        c.attend(bad)
    c.save(str(tmp_path / "b"))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    np.testing.assert_array_equal(c.attend(q), before)


def test_an_input_too_large_to_copy_is_a_memory_error():
    """Inputs are copied before the GIL is released; a broadcast view of 2^40 elements
    cannot be, and raises MemoryError instead of aborting the interpreter."""
    big = np.broadcast_to(np.float32(0.1), (2**35, KV, D))
    c = mosaickv.FullCache(KV, D)
    with pytest.raises(MemoryError):
        c.prefill(big, big)
    assert len(c) == 0


def test_config_json_must_be_an_object_and_configs_pickle():
    import copy
    import pickle
    for text in ["[1]", "0.5", "null", "{not json"]:
        with pytest.raises(mosaickv.InvalidConfigError):
            mosaickv.Config.from_json(text)
    cfg = mosaickv.Config(token_rate=0.3, input_segment_len=64)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert copy.deepcopy(cfg) == cfg
    assert copy.copy(cfg).token_rate == 0.3
