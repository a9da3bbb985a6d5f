"""The method registry through the Python package (issue 39): every method string the docs
mention gives, through `mosaickv.from_method`, the output `mosaickv attend --method` gives,
bit for bit, or the same refusal. `cli/tests/registry.rs` checks the engine and the registry's
Rust side the same way."""

import json
import re

import numpy as np
import pytest

import mosaickv
from conftest import ROOT, low_rank_kv, queries, run_cli

NAMES = ["full", "quest", "quest-sink", "naive2d", "kvq8", "kvq4", "kvq8-norot", "kvq4-norot", "turboquant",
         "mosaic", "mosaic-ref"]
# `turboquant:4bit_nc`: its preset comes first, without a key
WORD = re.compile(r"^(" + "|".join(re.escape(n) for n in NAMES) + r")(:[a-z0-9_]+)?(:[a-z]+=[^:\s]+)*$")


def doc_method_strings():
    files = [ROOT / "README.md", ROOT / "spec" / "SPEC.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for f in files:
        spans = f.read_text().split("`")[1::2]
        for span in spans:
            for word in re.split(r"[\s,]+", span):
                if WORD.match(word) and word not in found:
                    found.append(word)
    return found


WORDS = doc_method_strings()


def test_the_docs_name_every_method():
    for name in NAMES:
        assert any(w.split(":")[0] == name for w in WORDS), name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("registry")
    k, v = low_rank_kv(7, 700, 2, 64)
    # f16-exact, as dense.mkv stores them
    k = k.astype(np.float16).astype(np.float32)
    v = v.astype(np.float16).astype(np.float32)
    q = queries(8, 4, 64)
    np.save(d / "k.npy", k)
    np.save(d / "v.npy", v)
    np.save(d / "q.npy", q)
    return d, k, v, q


@pytest.mark.parametrize("word", WORDS)
def test_a_method_string_builds_the_cache_mosaickv_attend_builds(cli, data, word):
    d, k, v, q = data
    try:
        cache = mosaickv.from_method(word, 2, 64)
        cache.prefill(k, v)
        got = cache.attend(q)
    except mosaickv.MosaicError as e:
        got = e
    cfg = cache.config.to_json() if isinstance(got, np.ndarray) and isinstance(cache, mosaickv.Cache) else "{}"
    (d / "cfg.json").write_text(cfg)
    # `mosaic-ref` compresses with the implementation it names (the two write the same bytes)
    backend = "reference" if word.split(":")[0] == "mosaic-ref" else "optimized"
    rc, _, err = run_cli(cli, "compress", "--keys", d / "k.npy", "--values", d / "v.npy", "--config", d / "cfg.json",
                         "--backend", backend, "--out", d / "c")
    assert rc == 0, err
    attend_word = word
    if isinstance(got, np.ndarray) and isinstance(cache, mosaickv.Cache):
        # a saved MosaicKV cache keeps its configuration: attend takes the name and the rate
        attend_word = f"{word.split(':')[0]}:rate={json.loads(cfg)['token_rate']}"
    rc, _, err = run_cli(cli, "attend", "--cache", d / "c", "--queries", d / "q.npy", "--method", attend_word,
                         "--out", d / "o.npy")
    if isinstance(got, Exception):
        assert rc != 0 and str(got).split(": ", 1)[-1] in err, (got, err)
        return
    assert rc == 0, err
    np.testing.assert_array_equal(got, np.load(d / "o.npy"))


def test_a_bad_method_string_is_a_typed_error():
    for bad in ["", "dense", "quest:rate=2", "mosaic:foo=1", "naive2d:ret=0", "kvq8:rate=0.5"]:
        with pytest.raises(mosaickv.InvalidConfigError):
            mosaickv.from_method(bad, 2, 64)


def test_naive2d_and_quest_sink_say_they_run_on_the_reference():
    for word in ["naive2d", "quest-sink"]:
        assert mosaickv.from_method(word, 2, 64, backend="cpu").backend == "reference"
    assert mosaickv.from_method("quest", 2, 64).backend == "cpu"


@pytest.mark.parametrize("preset", ["4bit_nc", "k8v4", "k3v4_nc", "3bit_nc"])
def test_turboquant_runs_on_the_cpu_backend_with_the_references_bits(preset):
    """Every TurboQuant preset has a CPU cache (issue 37): the same output bits as the
    reference's, on the same prompt and generated tokens."""

    caches = {b: mosaickv.from_method(f"turboquant:{preset}", 2, 64, backend=b) for b in ("cpu", "reference")}
    assert caches["cpu"].backend == "cpu" and caches["reference"].backend == "reference"
    k, v = low_rank_kv(3, 150, 2, 64)
    for c in caches.values():
        c.prefill(k[:140], v[:140])
        for t in range(140, 150):
            c.append(k[t], v[t])
    q = queries(5, 6, 64)
    assert caches["cpu"].memory() == caches["reference"].memory()
    np.testing.assert_array_equal(caches["cpu"].attend(q), caches["reference"].attend(q))
