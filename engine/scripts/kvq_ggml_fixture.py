#!/usr/bin/env python3
"""Writes conformance/tests/fixtures/kvq_ggml.txt: f32 rows and the q8_0 / q4_0 blocks that
ggml itself (the libggml shipped in llama-cpp-python) writes for them.

Usage:  python3 -m pip install llama-cpp-python numpy
        python3 engine/scripts/kvq_ggml_fixture.py

Calls, through ctypes, ggml's `quantize_row_q8_0_ref` and `quantize_row_q4_0_ref` (libggml-base,
what SPEC.md section 12 prescribes) and the CPU backend's `quantize_row_q8_0` (libggml-cpu, the
SIMD variant llama.cpp's CPU backend uses when it writes a q8_0 KV cache on this machine). The
rows mix random normals, exact halves after scaling (rounding ties), repeated magnitudes of
both signs (q4_0's signed max), zeros, tiny values and outliers. The file has four lines: the
f32 values as hex bit patterns, then the q8_0 ref, q4_0 ref and q8_0 CPU blocks as hex.
conformance/tests/kvq.rs checks that both of our caches write the ref bytes exactly and
counts the blocks where the CPU variant differs.
"""
import ctypes
import os

import numpy as np
import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "conformance", "tests", "fixtures", "kvq_ggml.txt")
LIB = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")


def rows():
    rng = np.random.default_rng(14)
    blocks = []
    for i in range(256):
        kind = i % 8
        if kind == 0:
            b = rng.normal(0, 1, 32)
        elif kind == 1:  # heavy outlier
            b = rng.normal(0, 0.1, 32)
            b[rng.integers(32)] = rng.choice([-1, 1]) * rng.uniform(5, 50)
        elif kind == 2:  # q8_0 ties: amax 127 * s, others (k + 0.5) * s
            s = 2.0 ** rng.integers(-8, 4)
            b = (rng.integers(-126, 126, 32) + 0.5) * s
            b[rng.integers(32)] = 127 * s * rng.choice([-1, 1])
        elif kind == 3:  # q4_0 signed max ties: +m and -m both present
            m = rng.uniform(0.5, 4)
            b = rng.uniform(-m, m, 32)
            b[3], b[20] = m, -m
            if rng.integers(2):
                b[3], b[20] = -m, m
        elif kind == 4:  # q4_0 ties: x / d + 8.5 on integers
            d = 2.0 ** rng.integers(-6, 2)
            b = (rng.integers(-8, 8, 32) - 0.5) * d
            b[0] = -8 * d
        elif kind == 5:
            b = np.zeros(32)
            b[rng.integers(32)] = rng.normal()
        elif kind == 6:  # f16 subnormal or underflowing scales
            b = rng.normal(0, 1e-6, 32)
        else:
            b = rng.uniform(-300, 300, 32)
        blocks.append(b)
    return np.concatenate(blocks).astype(np.float32)


def quantize(lib, name, x, block_bytes):
    f = getattr(lib, name)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f.restype = None
    out = np.zeros(len(x) // 32 * block_bytes, dtype=np.uint8)
    f(x.ctypes.data, out.ctypes.data, len(x))
    return out


def main():
    base = ctypes.CDLL(os.path.join(LIB, "libggml-base.so"))
    cpu = ctypes.CDLL(os.path.join(LIB, "libggml-cpu.so"))
    x = np.ascontiguousarray(rows())
    q8 = quantize(base, "quantize_row_q8_0_ref", x, 34)
    q4 = quantize(base, "quantize_row_q4_0_ref", x, 18)
    q8cpu = quantize(cpu, "quantize_row_q8_0", x, 34)
    diff = sum(1 for i in range(len(x) // 32) if (q8[i * 34:(i + 1) * 34] != q8cpu[i * 34:(i + 1) * 34]).any())
    with open(OUT, "w") as f:
        f.write(" ".join(f"{v:08x}" for v in x.view(np.uint32)) + "\n")
        for q in (q8, q4, q8cpu):
            f.write(q.tobytes().hex() + "\n")
    print(f"wrote {os.path.normpath(OUT)}: {len(x) // 32} blocks, llama-cpp-python {llama_cpp.__version__}; "
          f"q8_0 CPU variant differs from ref in {diff} blocks")


if __name__ == "__main__":
    main()
