"""Shared fixtures: the repository root, the CLI binary, seeded K/V/Q arrays."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "cli" / "tests" / "fixtures"


def exact_attention(keys, values, queries):
    """SPEC 9 / 12 Full in float64: softmax(q.k / sqrt(D)) v per query head, GQA."""
    k = np.asarray(keys, np.float64)
    v = np.asarray(values, np.float64)
    q = np.asarray(queries, np.float64)
    kv, d = k.shape[1], k.shape[2]
    group = q.shape[0] // kv
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        j = h // group
        z = k[:, j, :] @ q[h] / np.sqrt(d)
        p = np.exp(z - z.max())
        out[h] = (p / p.sum()) @ v[:, j, :]
    return out


def rel_l2(a, b):
    """SPEC 16: ||a - b||_F / ||b||_F (0 when both are 0)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return 0.0 if nb == 0 and np.linalg.norm(a) == 0 else float(np.linalg.norm(a - b) / nb)


def low_rank_kv(seed, tokens, kv_heads, head_dim, rank=4):
    """Low-rank K/V plus noise (as cli/tests/fixtures/make_fixtures.py), float32."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((kv_heads, rank, head_dim))
    mk = lambda: np.einsum("thr,hrd->thd", rng.standard_normal((tokens, kv_heads, rank)), basis) + 0.05 * rng.standard_normal(
        (tokens, kv_heads, head_dim)
    )
    return mk().astype(np.float32), mk().astype(np.float32)


def queries(seed, q_heads, head_dim):
    return np.random.default_rng(seed).standard_normal((q_heads, head_dim)).astype(np.float32)


@pytest.fixture(scope="session")
def cli():
    """The `mosaickv` binary, built from this checkout (release), or $MOSAICKV_CLI."""
    given = os.environ.get("MOSAICKV_CLI")
    if given:
        return Path(given)
    cargo = shutil.which("cargo")
    if cargo is None:
        if os.environ.get("CI"):
            pytest.fail("cargo not found: the CLI comparison needs it in CI")
        pytest.skip("cargo not found: cannot build the mosaickv CLI to compare with")
    subprocess.run(
        [cargo, "build", "--release", "-q", "-p", "mosaickv-cli"], cwd=ROOT, check=True
    )
    meta = subprocess.run(
        [cargo, "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    return Path(json.loads(meta.stdout)["target_directory"]) / "release" / "mosaickv"


def run_cli(cli, *args):
    """Runs the CLI; returns (returncode, stdout, stderr)."""
    p = subprocess.run([str(cli), *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def cli_error_line(stderr):
    """The message of `mosaickv: error: MESSAGE` (the last such line)."""
    lines = [l for l in stderr.splitlines() if l.startswith("mosaickv: error: ")]
    assert lines, f"no error line in {stderr!r}"
    return lines[-1][len("mosaickv: error: "):]


def rows_memory(m):
    """A cache's `memory()` without the host scratch (the live CPU cache's covariance
    accumulators, SPEC section 13's `host_scratch`, which the reference does not keep) and
    the host total that includes it: what two backends holding the same rows must agree on."""
    return {k: v for k, v in m.items() if k not in ("host_scratch", "host_bytes")}


def covariance_bytes(kv_heads, head_dim):
    """SPEC section 10.4: two f64 D x D accumulators per KV head while a segment is open."""
    return 2 * kv_heads * head_dim * head_dim * 8
