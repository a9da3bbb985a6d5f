"""The attention backend: vLLM's CPU backend with decode attention on a MosaicKV cache.

Phase 1 of docs/VLLM.md ("vLLM's pages as dense staging, compressed segments in a side
store"): vLLM keeps writing every token's K/V into its paged cache, and computes prefill
attention on it as always. Per layer and running sequence, this backend also holds one MosaicKV
cache (the ``mosaickv`` package, Rust): the prompt's K/V go in as its prefill (SPEC 10.1), each
generated token is appended (SPEC 10.2) and its query attended on the compressed cache (SPEC
8-9); that output replaces vLLM's for the decode token.

A sequence is known by its request id, which the model runner publishes for each step's rows
(`batch.py`: vLLM's attention metadata carries none); its caches are freed when the request
finishes or is preempted, and kept while it is merely not scheduled. Where the runner's rows are
not known (another runner, a dummy run), a row is known by the first physical block of its block
table (a live sequence owns its first block) and sequences not scheduled in a step are dropped.
Whenever the cache held for a sequence does not have exactly the tokens before this step (a new
request that reuses the block, a prefix-cache hit, a chunked or resumed prefill, a preempted
sequence), it is rebuilt from vLLM's pages, which hold every token: the pages are the source of
truth, the MosaicKV caches a derived store.

What vLLM's memory accounting sees is unchanged in this phase: its pages stay dense, and the
MosaicKV caches come on top (docs/VLLM.md, section 2 (a)).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import time

import numpy as np
import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

import mosaickv

from . import batch
from . import method as configured_method


class MosaicKVBackend(CPUAttentionBackend):
    """vLLM's CPU backend (same name, metadata builder and page layout), MosaicKV's decode."""

    @staticmethod
    def get_impl_cls() -> type["MosaicKVImpl"]:
        return MosaicKVImpl


@functools.lru_cache(maxsize=None)
def page_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> torch.Tensor:
    """Where vLLM's page write puts each token's K and V inside one block and head.

    vLLM's CPU kernels keep their own layout inside a page (keys transposed for the "vec" ISA,
    other orders for AMX and bf16), so it is measured, not assumed: two writes of known rows
    through vLLM's own `cpu_attn_reshape_and_cache` (first each element's token index, then its
    dim index; both exact in bf16 for sizes up to 256). Returns, for keys then values, the
    flat position inside the block-and-head region of element (token, dim): a
    `[2, block_size * head_size]` index tensor."""
    from vllm import _custom_ops as ops

    bs, d = block_size, head_size
    if bs > 256 or d > 256:
        raise ValueError(f"page_layout: block_size {bs} and head_size {d} must be at most 256")
    pages = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
    view = pages.view(1, 1, 2 * bs, d)
    key_cache, value_cache = view.chunk(2, dim=2)
    tok = torch.arange(bs, dtype=torch.float32)[:, None, None].expand(bs, 1, d) + 1
    dim = torch.arange(d, dtype=torch.float32)[None, None, :].expand(bs, 1, d) + 1
    seen = []
    for rows in (tok, dim):
        pages.zero_()
        rows = rows.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(rows, rows, key_cache, value_cache,
                                       torch.arange(bs, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        seen.append(view[0, 0].reshape(2, bs * d).to(torch.float32).round().long() - 1)
    t, j = seen
    if (t < 0).any() or (j < 0).any():
        raise RuntimeError("page_layout: vLLM's page write left positions unwritten")
    where = torch.empty(2, bs * d, dtype=torch.long)
    for side in range(2):
        where[side, t[side] * d + j[side]] = torch.arange(bs * d)
    return where


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None  # not glibc: no heap figures, no trim


def _memory_log(impl, layer, seq: int, tokens: int, cache, seconds: float) -> None:
    """One JSON line per cache built from the pages, to the file MOSAICKV_VLLM_MEMLOG names:
    the cache's own bytes (SPEC 13) beside the process's resident memory and glibc's heap
    figures, so that memory the caches do not explain can be told apart (docs/VLLM.md)."""
    path = os.environ.get("MOSAICKV_VLLM_MEMLOG")
    if not path:
        return
    with open("/proc/self/status") as f:
        st = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith("Vm")}
    libc = _libc()
    heap = {}
    if libc is not None:
        mi = libc.mallinfo2()
        heap = {"arena": mi.arena, "mmapped": mi.hblkhd, "in_use": mi.uordblks + mi.hblkhd,
                "free_held": mi.fordblks}
    mem = cache.memory()
    row = {"pid": os.getpid(), "layer": getattr(layer, "layer_name", None), "seq": seq,
           "tokens": tokens, "build_s": round(seconds, 4), "device_bytes": mem["device_bytes"],
           "host_rows": mem["host_rows"], "host_scratch": mem.get("host_scratch", 0),
           "caches": len(impl.caches) + 1,
           "rss": st.get("VmRSS"), "hwm": st.get("VmHWM"), **heap}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _release_freed_heap() -> None:
    """Hands the heap pages freed by a cache build back to the system (glibc `malloc_trim`).
    A build from the pages allocates and frees about ten times the compressed cache's bytes
    (the f32 copies of the pages, the fit's rotated rows), from several threads' arenas, and
    glibc keeps those pages: measured on SmolLM2 at 8K, batch 4, 1.9 GB held free against
    0.3 GB of caches (docs/VLLM.md)."""
    libc = _libc()
    if libc is None:
        return
    t0 = time.perf_counter()
    libc.malloc_trim(0)
    path = os.environ.get("MOSAICKV_VLLM_MEMLOG")
    if path:
        with open("/proc/self/status") as f:
            rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
        mi = libc.mallinfo2()
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "trim_s": round(time.perf_counter() - t0, 4),
                                "rss": rss, "arena": mi.arena, "free_held": mi.fordblks}) + "\n")


_announced: set[bool] = set()


def _announce_keying(by_request: bool) -> None:
    """Logs once per process and kind how a step's rows were keyed (the checks read it)."""
    if by_request in _announced:
        return
    _announced.add(by_request)
    from vllm.logger import init_logger

    init_logger("vllm.plugins.mosaickv").info(
        "mosaickv_vllm: rows keyed by %s", "request id" if by_request else "first block")


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


class MosaicKVImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.method = configured_method() or "full"
        self.caches: dict[object, object] = {}
        self.seen_step = 0
        if self.attn_type != AttentionType.DECODER:
            return  # encoder attention keeps vLLM's path
        refused = []
        if self.alibi_slopes is not None:
            refused.append("ALiBi slopes")
        if self.sliding_window != -1:
            refused.append(f"a sliding window ({self.sliding_window})")
        if self.logits_soft_cap:
            refused.append(f"a logits soft cap ({self.logits_soft_cap})")
        if self.sinks is not None:
            refused.append("attention sinks")
        if self.kv_cache_dtype != "auto":
            refused.append(f"kv_cache_dtype {self.kv_cache_dtype!r}")
        if self.kv_sharing_target_layer_name is not None:
            refused.append("KV sharing between layers")
        if abs(self.scale - self.head_size**-0.5) > 1e-6 * self.head_size**-0.5:
            refused.append(f"softmax scale {self.scale} (MosaicKV attends with 1/sqrt(head_size))")
        if refused:
            raise ValueError(
                "mosaickv_vllm cannot run this model's attention: " + ", ".join(refused)
                + "; set MOSAICKV_VLLM=off to serve it with vLLM's own cache"
            )

    def _new_cache(self):
        return mosaickv.from_method(self.method, self.num_kv_heads, self.head_size)

    def _from_pages(self, layer, kv_cache: torch.Tensor, blocks: torch.Tensor, tokens: int):
        """A fresh cache prefilled with the sequence's first ``tokens`` tokens, read from
        vLLM's pages: per block and head a region of block_size keys, then block_size values,
        each in the kernel's own order (`page_layout`)."""
        nb, h, bs, _ = kv_cache.size()
        d = self.head_size
        where = page_layout(layer.isa, kv_cache.dtype, bs, d)
        used = (tokens + bs - 1) // bs
        rows = kv_cache.view(nb, h, 2, bs * d)[blocks[:used].long()]  # [used, h, 2, bs D]
        keys = rows[:, :, 0, where[0]].view(used, h, bs, d)
        values = rows[:, :, 1, where[1]].view(used, h, bs, d)
        keys = keys.permute(0, 2, 1, 3).reshape(used * bs, h, d)[:tokens]
        values = values.permute(0, 2, 1, 3).reshape(used * bs, h, d)[:tokens]
        cache = self._new_cache()
        cache.prefill(_f32(keys), _f32(values))
        return cache

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if (attn_metadata is None or self.attn_type != AttentionType.DECODER
                or kv_cache.numel() == 0):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by the MosaicKV backend"
            )
        starts = attn_metadata.query_start_loc.tolist()
        # vLLM's dense kernel runs only for a step with prompt tokens (their attention is
        # vLLM's); a step of decode tokens alone is attended by MosaicKV alone.
        if any(b - a > 1 for a, b in zip(starts, starts[1:])):
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
        lens = attn_metadata.seq_lens.tolist()
        table = attn_metadata.block_table
        n = attn_metadata.num_actual_tokens
        heads = output[:n].view(n, self.num_heads, self.head_size)
        # Request ids of the rows, when the runner published this step's (batch.py).
        qlens = [b - a for a, b in zip(starts, starts[1:])]
        while qlens and qlens[-1] == 0:
            qlens.pop()  # padding rows
        rows = batch.rows_for(qlens)
        by_request = rows is not None
        if qlens:
            _announce_keying(by_request)
        if by_request:
            self.seen_step, gone = batch.ended_since(self.seen_step)
            for seq in [s for s in self.caches if s in gone or isinstance(s, tuple)]:
                del self.caches[seq]  # ended, or keyed by block before the rows were known
        live = set()
        built = 0
        for i, total in enumerate(lens):
            a, b = starts[i], starts[i + 1]
            if b <= a:
                continue
            seq = rows[i] if by_request else ("block", int(table[i, 0]))
            live.add(seq)
            cache = self.caches.get(seq)
            if b - a > 1:
                # prompt tokens: vLLM's dense attention stands. The cache is built from the
                # pages at the sequence's first decode step, once: a long prompt comes in
                # chunks (vLLM's CPU build schedules 4,096 tokens a step by default), and a
                # build per chunk would compress its first chunks again and again.
                self.caches.pop(seq, None)
                continue
            if cache is None or len(cache) != total - 1:
                t0 = time.perf_counter()
                cache = self._from_pages(layer, kv_cache, table[i], total - 1) if total > 1 else None
                if cache is not None:
                    built += 1
                    _memory_log(self, layer, seq, total - 1, cache, time.perf_counter() - t0)
            if cache is None:
                cache = self._new_cache()
                cache.prefill(_f32(key[a:b]), _f32(value[a:b]))
            else:
                cache.append(_f32(key[a]), _f32(value[a]))
            self.caches[seq] = cache
            o = cache.attend(_f32(query[a]))
            heads[a].copy_(torch.from_numpy(o).to(heads.dtype))
        if not by_request:
            for seq in [s for s in self.caches if s not in live]:
                del self.caches[seq]
        if built:
            _release_freed_heap()
        return output
