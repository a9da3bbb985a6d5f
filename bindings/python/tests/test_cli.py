"""The package against the `mosaickv` CLI: same arrays, same outputs (bit for bit),
same file format, same error messages."""

import json

import numpy as np
import pytest

import mosaickv
from conftest import FIXTURES, cli_error_line, low_rank_kv, queries, run_cli


def cli_attend(cli, cache_dir, q_path, method, out, *extra):
    rc, _, err = run_cli(cli, "attend", "--cache", cache_dir, "--queries", q_path, "--method", method, "--out", out, *extra)
    assert rc == 0, err
    return np.load(out)


def fixture_arrays():
    return (np.load(FIXTURES / "keys_f16.npy"), np.load(FIXTURES / "values_f32.npy"), np.load(FIXTURES / "queries_f32.npy"))


def test_default_mosaic_equals_the_cli_on_the_fixtures(cli, tmp_path):
    k, v, q = fixture_arrays()
    assert k.dtype == np.float16 and q.flags.f_contiguous  # f16 keys, Fortran-order queries
    rc, _, err = run_cli(cli, "compress", "--keys", FIXTURES / "keys_f16.npy", "--values", FIXTURES / "values_f32.npy", "--out", tmp_path / "c")
    assert rc == 0, err
    expect = cli_attend(cli, tmp_path / "c", FIXTURES / "queries_f32.npy", "mosaic", tmp_path / "o.npy")
    cache = mosaickv.Cache(k.shape[1], k.shape[2])
    cache.prefill(k, v)
    np.testing.assert_array_equal(cache.attend(q), expect)
    # The CLI's file, loaded by the package, gives the same output too.
    np.testing.assert_array_equal(mosaickv.Cache.load(tmp_path / "c" / "cache.mkv").attend(q), expect)


@pytest.mark.parametrize("method,make", [
    ("full", lambda kv, d: mosaickv.FullCache(kv, d)),
    ("quest", lambda kv, d: mosaickv.QuestCache(kv, d, token_rate=0.2)),
    # both front ends with their defaults (retention 0.5, min_budget_tokens 256): one default
    ("naive2d", lambda kv, d: mosaickv.Naive2dCache(kv, d, token_rate=0.2)),
])
def test_baselines_equal_the_cli(cli, tmp_path, method, make):
    k, v, q = fixture_arrays()
    rc, _, err = run_cli(cli, "compress", "--keys", FIXTURES / "keys_f16.npy", "--values", FIXTURES / "values_f32.npy", "--out", tmp_path / "c")
    assert rc == 0, err
    expect = cli_attend(cli, tmp_path / "c", FIXTURES / "queries_f32.npy", method, tmp_path / "o.npy", "--token-rate", "0.2")
    cache = make(k.shape[1], k.shape[2])
    cache.prefill(k, v)
    np.testing.assert_array_equal(cache.attend(q), expect)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mosaic_equals_the_cli_with_a_config_and_several_segments(cli, tmp_path, backend):
    kv, qh, d = 2, 8, 32
    k, v = low_rank_kv(40, 700, kv, d)
    q = queries(41, qh, d)
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", v)
    np.save(tmp_path / "q.npy", q)
    cfg = mosaickv.Config(input_segment_len=200, token_rate=0.3, sink_tokens=2)
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    cli_backend = {"cpu": "optimized", "reference": "reference"}[backend]
    rc, _, err = run_cli(cli, "compress", "--keys", tmp_path / "k.npy", "--values", tmp_path / "v.npy",
                         "--config", tmp_path / "cfg.json", "--backend", cli_backend, "--out", tmp_path / "c")
    assert rc == 0, err
    expect = cli_attend(cli, tmp_path / "c", tmp_path / "q.npy", "mosaic", tmp_path / "o.npy", "--backend", cli_backend)
    cache = mosaickv.Cache(kv, d, cfg, backend=backend)
    cache.prefill(k, v)
    np.testing.assert_array_equal(cache.attend(q), expect)
    # Strategies as the CLI's manifest reports them.
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert len(cache.segments) == len(manifest["segments"]) > 1
    for seg, ms in zip(cache.segments, manifest["segments"]):
        assert (seg.start, seg.len) == (ms["start"], ms["len"])
        for h, mh in zip(seg.heads, ms["heads"]):
            assert h.block_size == mh["block_size"]
            assert (h.key.r, h.key.g, h.key.kept_dims, h.key.fit_loss) == (mh["key"]["r"], mh["key"]["g"], mh["key"]["kept_dims"], mh["key"]["fit_loss"])


def test_a_saved_cache_is_read_by_the_cli(cli, tmp_path):
    """`save` writes the CLI's cache.mkv: open segment, buffer and host rows included."""
    kv, d = 2, 16
    k, v = low_rank_kv(42, 300, kv, d)
    cache = mosaickv.Cache(kv, d, mosaickv.Config(input_segment_len=128))
    cache.prefill(k, v)
    k2, v2 = low_rank_kv(43, 150, kv, d)
    for t in range(150):
        cache.append(k2[t], v2[t])
    assert cache.segments[-1].state == "open" and cache.memory()["host_rows"] > 0
    (tmp_path / "c").mkdir()
    cache.save(tmp_path / "c" / "cache.mkv")
    q = queries(44, 4, d)
    np.save(tmp_path / "q.npy", q)
    np.testing.assert_array_equal(cli_attend(cli, tmp_path / "c", tmp_path / "q.npy", "mosaic", tmp_path / "o.npy"), cache.attend(q))
    rc, out, err = run_cli(cli, "inspect", "--cache", tmp_path / "c")
    assert rc == 0, err
    assert f"tokens {len(cache)}" in out


def test_error_messages_are_the_clis(cli, tmp_path):
    k, v = low_rank_kv(45, 50, 2, 16)
    k[7, 1, 3] = np.nan
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", v)
    rc, _, err = run_cli(cli, "compress", "--keys", tmp_path / "k.npy", "--values", tmp_path / "v.npy", "--out", tmp_path / "c")
    assert rc != 0
    with pytest.raises(mosaickv.NonFiniteError) as e:
        mosaickv.Cache(2, 16).prefill(k, v)
    assert str(e.value) == cli_error_line(err)

    (tmp_path / "cfg.json").write_text('{"token_rate": 0.2, "tokens_rate": 0.1}')
    rc, _, err = run_cli(cli, "compress", "--keys", FIXTURES / "keys_f16.npy", "--values", FIXTURES / "values_f32.npy",
                         "--config", tmp_path / "cfg.json", "--out", tmp_path / "c")
    assert rc != 0
    with pytest.raises(mosaickv.UnknownConfigKeyError) as e:
        mosaickv.Config(token_rate=0.2, tokens_rate=0.1)
    assert str(e.value) == cli_error_line(err)

    # A damaged file: the same path, the same message.
    rc, _, err = run_cli(cli, "compress", "--keys", FIXTURES / "keys_f16.npy", "--values", FIXTURES / "values_f32.npy", "--out", tmp_path / "d")
    assert rc == 0, err
    path = tmp_path / "d" / "cache.mkv"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    rc, _, err = run_cli(cli, "attend", "--cache", tmp_path / "d", "--queries", FIXTURES / "queries_f32.npy", "--method", "mosaic", "--out", tmp_path / "o.npy")
    assert rc != 0
    with pytest.raises(mosaickv.BadFormatError) as e:
        mosaickv.Cache.load(path)
    assert str(e.value) == cli_error_line(err)
