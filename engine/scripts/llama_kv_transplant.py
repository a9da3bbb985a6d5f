#!/usr/bin/env python3
"""A llama.cpp KV cache written from a stored prefill of ours, so that llama.cpp decodes at 16K-32K
tokens without its own prefill (issue 38).

Why: llama.cpp's CPU flash attention runs a prompt over a quantized K/V cache through its scalar
per-row path (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`; the tiled GEMM path takes F16/F32
caches only), so its q4_0 prefill took 48 min at 16K on a 2-vCPU machine (docs/PERFORMANCE.md
section 6) and would take hours at 32K. Decode speed does not depend on what the cache holds,
only on its type and length, so this module fills llama.cpp's cache the way llama.cpp would have:

* the post-RoPE keys and the values of each layer come from our dense prefill of the same token
  ids (`$MOSAICKV_HOME/prefills/*.mkvp`, `engine/src/store.rs`; our forward pass, not llama.cpp's,
  so the values differ from llama.cpp's own in the last bits and its greedy text may differ);
* for q8_0 / q4_0 each K and V row is Hadamard-rotated exactly as llama.cpp does for a quantized
  cache since 2026-04 (SPEC.md section 12: `H_nk` blocks on K, `H_64` blocks on V, ggml's f32 fast
  Walsh-Hadamard transform; skipped under LLAMA_ATTN_ROT_DISABLE) and quantized by ggml's own CPU
  row quantizer (`quantize_row_q8_0` / `quantize_row_q4_0` in the libggml-cpu that llama-cpp-python
  ships), f16 rows are rounded by numpy (round to nearest even, as ggml's f32 -> f16);
* the bytes are laid out as `llama_state_seq_get_data` writes them and loaded with
  `llama_state_seq_set_data` into sequence 0 of a fresh context: the header word is copied from a
  real blob of the same context, then stream count 1, cell count, per cell (position, 1 sequence,
  id 0), `v_trans` 0 (flash attention on), the layer count, per layer the K type, row size and rows,
  then the same for V.

`compare_states` (run by `compare_llamacpp.py --llama-cache-from both`) checks the layout and the
rotation on a prompt that llama.cpp also prefills itself: the relative RMS difference of every
layer's dequantized K and V rows against llama.cpp's own cache (layer 0 sees the same inputs in
both engines up to rounding; later layers drift where llama.cpp's own prefill attends over a
lossy cache, as q4_0 does). A wrong layout or rotation gives about 1.4.

The last prompt token is not transplanted: llama.cpp evaluates it itself on top of the n-1 loaded
positions, which gives the logits of the first decode step.
"""
import ctypes
import glob
import json
import os
import struct

import numpy as np

# ggml_type ids and (block elements, block bytes, CPU row quantizer)
GGML = {"f16": (1, None), "f16-nofa": (1, None), "q8_0": (8, (32, 34, "quantize_row_q8_0")), "q4_0": (2, (32, 18, "quantize_row_q4_0"))}


def home():
    return os.environ.get("MOSAICKV_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mosaickv")


def read_prefill(path):
    """Our stored prefill (`MKVPFX01`): header and per layer (keys, values) as float32 memory maps of
    shape [tokens, kv_heads * head_dim]."""
    with open(path, "rb") as f:
        if f.read(8) != b"MKVPFX01":
            raise ValueError(f"{path}: not a stored prefill")
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        off = 16 + n
    t, width = h["tokens"], h["kv_heads"] * h["head_dim"]
    mm = np.memmap(path, dtype="<f4", mode="r", offset=off, shape=(2 * h["layers"], t, width))
    return h, [(mm[2 * l], mm[2 * l + 1]) for l in range(h["layers"])]


def find_prefill(tokens, layers, kv_heads, head_dim):
    """The stored prefill of `tokens` tokens with this shape (the newest one when several are)."""
    hits = []
    for p in glob.glob(os.path.join(home(), "prefills", "*.mkvp")):
        try:
            with open(p, "rb") as f:
                if f.read(8) != b"MKVPFX01":
                    continue
                h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        except (OSError, ValueError):
            continue
        if (h["tokens"], h["layers"], h["kv_heads"], h["head_dim"]) == (tokens, layers, kv_heads, head_dim):
            hits.append((os.path.getmtime(p), p))
    return max(hits)[1] if hits else None


def fwht(x, n):
    """ggml's CPU fast Walsh-Hadamard transform over blocks of n along the last axis, all f32:
    every value times 1/sqrtf(n), then the butterflies for len = 1, 2, ..., n/2."""
    shape = x.shape
    y = np.array(x, dtype=np.float32).reshape(-1, n) * np.float32(1.0 / np.sqrt(np.float32(n)))
    y = y.astype(np.float32)
    ln = 1
    while ln < n:
        y = y.reshape(-1, n // (2 * ln), 2, ln)
        a = y[:, :, 0, :].copy()
        b = y[:, :, 1, :].copy()
        y[:, :, 0, :] = a + b
        y[:, :, 1, :] = a - b
        y = y.reshape(-1, n)
        ln *= 2
    return y.reshape(shape)


def rotation_sizes(head_dim):
    """llama.cpp's attn_rot_k / attn_rot_v rule (SPEC.md section 12): None when 64 does not divide D."""
    if head_dim % 64:
        return None
    nk = 64
    while head_dim % (nk * 2) == 0 and nk * 2 <= head_dim:
        nk *= 2
    return nk, 64


class Quantizer:
    def __init__(self):
        import llama_cpp

        lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        self.cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"))

    def rows(self, kv, x):
        """Rows of f32 `x` [rows, width] as the cache type `kv` stores them (bytes [rows, row_size])."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if kv in ("f16", "f16-nofa"):
            return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], -1)
        elems, nbytes, name = GGML[kv][1]
        f = getattr(self.cpu, name)
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        f.restype = None
        out = np.empty(x.size // elems * nbytes, dtype=np.uint8)
        f(x.ctypes.data, out.ctypes.data, x.size)
        return out.reshape(x.shape[0], -1)


def state_header(llm):
    """The first word of a sequence state blob of this context (from a real one)."""
    import llama_cpp

    llm.reset()
    llm.eval([0])
    size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, size, 0)
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    return bytes(buf)[:8]


def build_state(header, kv, layers, head_dim, n, rotate, v_trans=False, chunk=4096):
    """The sequence-state bytes of the first n positions of `layers` [(keys, values)] stored as `kv`
    (`v_trans`: the V layout of a context with flash attention off)."""
    q = Quantizer()
    rot = rotation_sizes(head_dim) if (rotate and not kv.startswith("f16")) else None
    parts = [header, struct.pack("<II", 1, n)]
    meta = np.zeros((n, 3), dtype="<i4")  # per cell: position, 1 sequence, sequence id 0
    meta[:, 0] = np.arange(n)
    meta[:, 1] = 1
    parts.append(meta.tobytes())
    parts.append(struct.pack("<II", int(v_trans), len(layers)))
    for which in (0, 1):  # all K, then all V
        for keys_values in layers:
            x = keys_values[which]
            width = x.shape[1]
            blocks = []
            for s in range(0, n, chunk):
                rows = np.asarray(x[s:min(n, s + chunk)], dtype=np.float32)
                if rot is not None:
                    block = rot[0] if which == 0 else rot[1]
                    rows = fwht(rows.reshape(rows.shape[0], -1, head_dim), block).reshape(rows.shape[0], width)
                blocks.append(q.rows(kv, rows))
            data = np.concatenate(blocks)
            if which == 1 and v_trans:
                # flash attention off: V stored transposed, per layer the type, the element
                # size and the row width, then for each of the width's dimensions every cell
                if not kv.startswith("f16"):
                    raise ValueError("a transposed V cache (flash attention off) is f16 only here")
                elems = data.view(np.float16).reshape(n, width)
                parts.append(struct.pack("<iII", GGML[kv][0], 2, width))
                parts.append(np.ascontiguousarray(elems.T).tobytes())
            else:
                parts.append(struct.pack("<iQ", GGML[kv][0], data.shape[1]))
                parts.append(data.tobytes())
    return b"".join(parts)


def load_state(llm, blob, n_tokens, tokens):
    """Loads `blob` (n_tokens positions) into sequence 0 of a cleared context and tells
    llama-cpp-python's wrapper that those tokens are in it."""
    import llama_cpp

    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    read = llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(blob), 0)
    if read != len(blob):
        raise RuntimeError(f"llama_state_seq_set_data read {read} of {len(blob)} bytes")
    llm.input_ids[:n_tokens] = tokens[:n_tokens]
    llm.n_tokens = n_tokens


def seq_state(llm):
    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    w = llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, size, 0)
    return bytes(buf)[:w]


def parse_state(blob):
    """(cells, v_trans, [(kind, layer, ggml type, row bytes, offset)]) of a sequence-state blob
    (a transposed V's rows are stored dimension by dimension)."""
    o = 8
    streams, cells = struct.unpack_from("<II", blob, o)
    o += 8
    for _ in range(cells):
        _pos, nseq = struct.unpack_from("<iI", blob, o)
        o += 8 + 4 * nseq
    v_trans, n_layer = struct.unpack_from("<II", blob, o)
    o += 8
    out = []
    for kind in ("k", "v"):
        for l in range(n_layer):
            if kind == "v" and v_trans:
                t, es, width = struct.unpack_from("<iII", blob, o)
                rs = es * width  # bytes of one cell's row, stored transposed
            else:
                t, rs = struct.unpack_from("<iQ", blob, o)
            o += 12
            out.append((kind, l, t, rs, o))
            o += rs * cells
    if o != len(blob) or streams != 1:
        raise ValueError(f"unexpected state layout: {streams} streams, parsed {o} of {len(blob)} bytes")
    return cells, v_trans, out


def dequantize(kv, data):
    """f32 values of cache rows `data` (uint8 [rows, row_bytes]) of type `kv`."""
    data = np.ascontiguousarray(data)
    if kv.startswith("f16"):
        return data.view(np.float16).astype(np.float32).reshape(data.shape[0], -1)
    elems, nbytes, _ = GGML[kv][1]
    b = data.reshape(-1, nbytes)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    if kv == "q8_0":
        q = b[:, 2:].view(np.int8).astype(np.float32)
    else:  # q4_0: low nibbles are elements 0..15, high nibbles 16..31
        lo, hi = (b[:, 2:] & 15).astype(np.float32), (b[:, 2:] >> 4).astype(np.float32)
        q = np.concatenate([lo, hi], axis=1) - 8
    return (q * d).reshape(data.shape[0], -1)


def compare_states(kv, ours, theirs):
    """Relative RMS difference of each layer's K and V rows between two sequence-state blobs of the
    same context (the transplanted cache against llama.cpp's own), over the cells both hold: a
    wrong layout or rotation gives about 1 or more, rounding and the engines' arithmetic far less."""
    ca, va, ra = parse_state(ours)
    cb, vb, rb = parse_state(theirs)
    cells = min(ca, cb)
    out = {}
    for (kind, layer, _, rs, o), (_, _, _, rs2, o2) in zip(ra, rb):
        rows = []
        for blob, size, off, vt in ((ours, rs, o, va), (theirs, rs2, o2, vb)):
            n_all = ca if blob is ours else cb
            raw = np.frombuffer(blob, np.uint8, count=n_all * size, offset=off)
            if kind == "v" and vt:  # transposed: [width][cells] f16
                x = raw.view(np.float16).reshape(-1, n_all).T[:cells].astype(np.float32)
            else:
                x = dequantize(kv, raw.reshape(n_all, size)[:cells])
            rows.append(x)
        a, b = rows
        out[f"{kind}{layer}"] = float(np.sqrt(((a - b) ** 2).mean() / max((b ** 2).mean(), 1e-30)))
    return out
