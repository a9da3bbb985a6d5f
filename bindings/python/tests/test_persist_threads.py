"""Save/load round trips, and two threads attending at once."""

import threading

import numpy as np
import pytest

import mosaickv
from conftest import covariance_bytes, low_rank_kv, queries, rows_memory

KV, D = 2, 32


def grown(backend, seed=60, generated=200):
    """A cache with closed prompt segments, an open generated segment and a part-full buffer."""
    cache = mosaickv.Cache(KV, D, mosaickv.Config(input_segment_len=128, min_segment_len=128), backend=backend)
    k, v = low_rank_kv(seed, 300, KV, D)
    cache.prefill(k, v)
    k2, v2 = low_rank_kv(seed + 1, generated, KV, D)
    for t in range(generated):
        cache.append(k2[t], v2[t])
    return cache


@pytest.mark.parametrize("saver", ["cpu", "reference"])
@pytest.mark.parametrize("loader", ["cpu", "reference"])
def test_save_load_round_trip(tmp_path, saver, loader):
    cache = grown(saver)
    assert cache.memory()["host_rows"] > 0
    path = tmp_path / "cache.mkv"
    cache.save(path)
    back = mosaickv.Cache.load(path, backend=loader)
    assert back.backend == loader
    assert len(back) == len(cache)
    assert back.segments == cache.segments
    assert back.config == cache.config
    assert rows_memory(back.memory()) == rows_memory(cache.memory())
    # a loaded CPU cache with an open segment restores its covariance accumulators
    want = covariance_bytes(KV, D) if loader == "cpu" and back.segments[-1].state == "open" else 0
    assert back.memory()["host_scratch"] == want
    q = queries(62, 4 * KV, D)
    if saver == loader:
        np.testing.assert_array_equal(back.attend(q), cache.attend(q))
    # The loaded cache goes on growing exactly like the original.
    k3, v3 = low_rank_kv(63, 100, KV, D)
    for t in range(100):
        back.append(k3[t], v3[t])
        cache.append(k3[t], v3[t])
    assert back.segments == cache.segments
    if saver == loader:
        np.testing.assert_array_equal(back.attend(q), cache.attend(q))
    # Saving again gives the same bytes.
    cache.save(tmp_path / "a.mkv")
    back.save(tmp_path / "b.mkv")
    assert (tmp_path / "a.mkv").read_bytes() == (tmp_path / "b.mkv").read_bytes()


def test_two_threads_attend_two_caches_as_one_thread_does():
    caches = [grown("cpu", seed=70), grown("cpu", seed=80)]
    qs = [[queries(100 + 10 * i + j, 4 * KV, D) for j in range(20)] for i in range(2)]
    serial = [[c.attend(q) for q in qq] for c, qq in zip(caches, qs)]
    results = [None, None]
    errors = []
    start = threading.Barrier(2)

    def work(i):
        try:
            start.wait()
            results[i] = [caches[i].attend(q) for _ in range(5) for q in qs[i]]
        except Exception as e:  # reported below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        for n, out in enumerate(results[i]):
            np.testing.assert_array_equal(out, serial[i][n % 20])


def test_two_threads_on_one_cache_and_compressing_meanwhile():
    """One thread appends (compressing at each flush) while another attends another cache;
    a third attends the first one: the lock keeps every call whole."""
    a, b = grown("cpu", seed=90), grown("cpu", seed=91)
    q = queries(92, 2 * KV, D)
    b_expect = b.attend(q)
    k, v = low_rank_kv(93, 256, KV, D)
    errors = []

    def appender():
        for t in range(256):
            a.append(k[t], v[t])

    def attender():
        for _ in range(50):
            if not np.array_equal(b.attend(q), b_expect):
                errors.append("b changed")
            a.attend(q)

    ts = [threading.Thread(target=appender), threading.Thread(target=attender)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    serial = grown("cpu", seed=90)
    for t in range(256):
        serial.append(k[t], v[t])
    np.testing.assert_array_equal(a.attend(q), serial.attend(q))
    assert a.segments == serial.segments


def test_help_names_the_spec_sections():
    import pydoc

    text = pydoc.render_doc(mosaickv.Cache, renderer=pydoc.plaintext)
    for section in ["SPEC sections 1-11", "SPEC section 13", "SPEC section 15", "SPEC sections 8-9", "SPEC section 10.1"]:
        assert section in text, section
    assert "SPEC.md section 2" in pydoc.render_doc(mosaickv.Config, renderer=pydoc.plaintext)


SAVE_UNDER_LIMIT = r"""
import resource, signal, sys
import numpy as np
import mosaickv
sys.path.insert(0, sys.argv[3])
from conftest import low_rank_kv
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
kind, path = sys.argv[1], sys.argv[2]
k, v = low_rank_kv(21, 900, 2, 32)
cache = mosaickv.Cache(kv_heads=2, head_dim=32) if kind == "mosaic" else mosaickv.FullCache(2, 32)
cache.prefill(k, v)
limit = 4096
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    cache.save(path)
except OSError as e:
    print("refused:", e)
    sys.exit(3)
sys.exit(0)
"""


@pytest.mark.parametrize("kind", ["mosaic", "full"])
def test_a_failed_save_keeps_the_previous_file(tmp_path, kind):
    """Issue 40, class 1: a save that fails halfway (a file-size limit, as a full disk) leaves
    the previous file byte for byte, and no temporary file beside it (SPEC.md 15.7)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "cache.mkv"
    k, v = low_rank_kv(20, 300, 2, 32)
    first = mosaickv.Cache(kv_heads=2, head_dim=32) if kind == "mosaic" else mosaickv.FullCache(2, 32)
    first.prefill(k, v)
    first.save(str(path))
    before = path.read_bytes()
    assert len(before) > 4096
    r = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_LIMIT, kind, str(path), os.path.dirname(__file__)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "File too large" in r.stdout, r.stdout
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["cache.mkv"]
    loaded = (mosaickv.Cache if kind == "mosaic" else mosaickv.FullCache).load(str(path))
    assert len(loaded) == 300
