"""MosaicKV from numpy: 2-D KV-cache compression (rotation + per-vector top-r
channels, then Quest-style block selection), the Python face of the Rust
reference implementation.

Section numbers refer to the normative text, ``spec/SPEC.md`` of the repository.

    import numpy as np, mosaickv
    cache = mosaickv.Cache(kv_heads=2, head_dim=64)   # SPEC 2 defaults
    cache.prefill(K, V)                               # K, V: [tokens, 2, 64]
    out = cache.attend(Q)                             # Q: [q_heads, 64]; out float32

Inputs are float32 or float16 numpy arrays (anything else raises
:class:`DtypeError`). A float32 array is handed to the library as a view, not
copied, whatever its strides; the library then copies what it stores, and a
non-contiguous array is copied where contiguous rows are needed. A float16
array is first widened (exactly) into a new float32 array.
Every compression and attention call releases the GIL, so threads can attend
different caches at once. Errors are the classes of :mod:`mosaickv._errors`,
all under :class:`MosaicError`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import numpy as np

from . import _errors
from ._errors import *  # noqa: F401,F403  (the exception classes)
from ._errors import MosaicError
from ._mosaickv import FORMAT_VERSION, _Cache, config_check, config_paper, has_cuda

__all__ = [
    "Config",
    "Cache",
    "FullCache",
    "QuestCache",
    "Naive2dCache",
    "Kvq8Cache",
    "Kvq4Cache",
    "QuestSinkCache",
    "TurboQuantCache",
    "from_method",
    "SideStrategy",
    "HeadStrategy",
    "SegmentInfo",
    "has_cuda",
    "FORMAT_VERSION",
] + list(_errors.__all__)

PathLike = Union[str, "os.PathLike[str]"]


def _index(x: Any, name: str, what: str) -> int:
    """``x`` as a Python int the library can take (numpy integers accepted); negative or
    oversized values raise :class:`InvalidConfigError` saying it is not ``what``."""
    import operator

    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(x).__name__}") from None
    if v < 0 or v >= 2**63:
        raise _errors.InvalidConfigError(f"invalid configuration: {name} {v} is not {what}")
    return v


def _dims(kv_heads: Any, head_dim: Any) -> "tuple[int, int]":
    """``kv_heads`` and ``head_dim`` as Python ints the library can take. Zero is left to the
    library, which names the rule it breaks (SPEC section 1)."""
    return _index(kv_heads, "kv_heads", "a positive integer"), _index(head_dim, "head_dim", "a positive integer")


def _count(x: Any, name: str) -> int:
    """A count (``min_budget_tokens``) as a Python int."""
    return _index(x, name, "a non-negative integer")


def _plain(x: Any) -> Any:
    """numpy scalars and arrays as the Python numbers and lists JSON knows."""
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    raise TypeError(f"configuration value {x!r} of type {type(x).__name__} is not a number, list or dict")


class Config:
    """Every parameter of the method (SPEC.md section 2), validated.

    ``Config(**keys)`` takes any subset of the keys of SPEC section 2; the others
    take their defaults. Unknown keys raise :class:`UnknownConfigKeyError`,
    values out of range :class:`InvalidConfigError` (the same rules and messages
    as a ``--config`` JSON file of the CLI). Keys::

        token_rate, channels, truncate_fraction, block_sizes, variance_threshold,
        sink_tokens, input_segment_len, max_segment_len, min_segment_len,
        buffer_capacity, segment_loss_margin

    ``channels`` is a dict: ``{"mode": "fixed", "retention": 0.25, "group_size": 1}``
    or ``{"mode": "loss_threshold", "key_loss": ..., "value_loss": ...,
    "retentions": [...], "group_sizes": [...]}`` (SPEC section 11).
    Group sizes are checked against ``head_dim`` when a :class:`Cache` is built.

    Read a key as an attribute (``cfg.token_rate``); :meth:`to_dict` gives them all.
    """

    __slots__ = ("_d",)

    def __init__(self, **keys: Any) -> None:
        object.__setattr__(self, "_d", json.loads(config_check(json.dumps(keys, default=_plain))))

    @classmethod
    def paper(cls) -> "Config":
        """The paper's fixed setting (SPEC section 2): 25 % channels with g = 1,
        10 % tokens, 25 % truncation, blocks of 16."""
        return cls(**json.loads(config_paper()))

    @classmethod
    def from_json(cls, text: str) -> "Config":
        """A configuration from JSON text (the CLI's ``--config`` file format): a JSON
        object of keys; anything else raises :class:`InvalidConfigError`."""
        try:
            keys = json.loads(text)
        except ValueError as e:
            raise _errors.InvalidConfigError(f"malformed JSON: {e}") from None
        if not isinstance(keys, dict):
            raise _errors.InvalidConfigError(
                f"a configuration is a JSON object of named keys, not {type(keys).__name__}")
        return cls(**keys)

    def to_json(self) -> str:
        """Every key as JSON, readable by the CLI's ``--config``."""
        return json.dumps(self._d)

    def to_dict(self) -> Dict[str, Any]:
        """Every key and its value (a copy)."""
        return json.loads(json.dumps(self._d))

    def __getattr__(self, name: str) -> Any:
        # `_d` itself is looked up here only before __init__ set it (copy and pickle build
        # the object without calling __init__): no recursion
        if name == "_d":
            raise AttributeError(name)
        try:
            return json.loads(json.dumps(self._d[name]))
        except KeyError:
            raise AttributeError(name) from None

    def __reduce__(self):
        # pickle and copy rebuild from the keys, validated again
        return (_config_from_dict, (dict(self._d),))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable: build a new one, e.g. Config(**{**cfg.to_dict(), key: value})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._d == other._d

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self._d.items()) + ")"


@dataclass(frozen=True)
class SideStrategy:
    """How one side (K or V) of one KV head's segment is stored (SPEC sections 3-6, 11).

    ``r`` retained rotated values per vector, in groups of ``g``; ``dtype`` of the
    retained values; ``kept_dims`` rotated dims eligible for top-r (section 4);
    ``record_bytes`` per token (section 6); ``fit_loss`` the relative dropped
    energy the strategy was fitted with (section 11.1).
    """

    r: int
    g: int
    dtype: str
    kept_dims: int
    record_bytes: int
    fit_loss: float


@dataclass(frozen=True)
class HeadStrategy:
    """One KV head's strategy in a segment: ``block_size`` for token selection
    (SPEC section 11.3) and the ``key`` and ``value`` :class:`SideStrategy`."""

    block_size: int
    key: SideStrategy
    value: SideStrategy


@dataclass(frozen=True)
class SegmentInfo:
    """A segment: tokens ``start .. start + len``, ``state`` "closed" or "open"
    (SPEC section 10), and one :class:`HeadStrategy` per KV head."""

    start: int
    len: int
    state: str
    heads: List[HeadStrategy]


def _segment(d: Dict[str, Any]) -> SegmentInfo:
    heads = [
        HeadStrategy(h["block_size"], SideStrategy(**h["key"]), SideStrategy(**h["value"]))
        for h in d["heads"]
    ]
    return SegmentInfo(d["start"], d["len"], d["state"], heads)


class _Base:
    """The methods every cache has (the Rust ``KvCache`` trait)."""

    _inner: _Cache

    def prefill(self, keys: np.ndarray, values: np.ndarray) -> None:
        """The prompt's K/V, arrays ``[tokens, kv_heads, head_dim]`` of float32 or
        float16 (keys after RoPE; SPEC section 10.1 for MosaicKV). Only on an
        empty cache (:class:`AlreadyPrefilledError`). Releases the GIL."""
        self._inner.prefill(keys, values)

    def append(self, key: np.ndarray, value: np.ndarray) -> None:
        """One generated token's K/V, ``[kv_heads, head_dim]`` (SPEC section 10.2-10.3
        for MosaicKV). Releases the GIL."""
        self._inner.append(key, value)

    def attend(self, queries: np.ndarray) -> np.ndarray:
        """One decode step's attention, ``softmax(q.k / sqrt(head_dim)) v`` over the
        tokens the method attends (SPEC sections 8-9; section 12 for a baseline).

        ``queries`` is ``[q_heads, head_dim]`` with ``q_heads`` any positive multiple
        of ``kv_heads`` (GQA, SPEC section 1: query head h reads KV head
        ``h // (q_heads // kv_heads)``). Returns a new float32 array of the same
        shape. An empty cache raises :class:`EmptyCacheError`. Releases the GIL."""
        return self._inner.attend(queries)

    def __len__(self) -> int:
        """Tokens held."""
        return len(self._inner)

    def memory(self) -> Dict[str, Union[int, float]]:
        """Every byte held, by kind, as SPEC section 13 counts them: ``values``,
        ``bitmaps``, ``scales`` (int8/int4 record scales, coded sides' per-dim
        coding), ``padding``, ``block_meta``, ``rotations``, ``dense`` (sink and
        buffer rows), ``segment_headers``, their sum ``device_bytes``, and apart
        ``host_rows`` (host f32 rows of the open segment and buffer) and
        ``host_scratch`` (a live cache's covariance accumulators), their sum
        ``host_bytes``; plus ``tokens``, ``bytes_per_token`` and
        ``dense_f16_bytes_per_token``."""
        return self._inner.memory()

    @property
    def kv_heads(self) -> int:
        return self._inner.shape()[0]

    @property
    def head_dim(self) -> int:
        return self._inner.shape()[2]

    @property
    def backend(self) -> str:
        """``"cpu"``, ``"reference"`` or ``"cuda"``."""
        return self._inner.backend()

    def __repr__(self) -> str:
        kv, _, d = self._inner.shape()
        return f"{type(self).__name__}(kv_heads={kv}, head_dim={d}, backend={self.backend!r}, tokens={len(self)})"


class Cache(_Base):
    """The MosaicKV cache of one attention layer (SPEC sections 1-11).

    ``Cache(kv_heads, head_dim, config=None, backend="cpu")``:

    - ``config``: a :class:`Config` (default: ``Config()``, SPEC section 2).
    - ``backend``: ``"cpu"``, the optimized production cache (the one
      ``mosaickv attend`` runs; AVX2/AVX-512 where the CPU has them);
      ``"reference"``, the readable oracle of SPEC.md; ``"cuda"``, attention on
      the GPU, only in a build with the ``cuda`` feature and a driver
      (:class:`BackendUnavailableError` otherwise); compression runs on the
      CPU and each ``attend`` uploads the cache (for trying the backend, not
      for speed). Backends write the same packed bytes (SPEC sections 5-7)
      and agree on attention within the conformance tolerances.

    Methods: :meth:`prefill` (SPEC 10.1), :meth:`append` (10.2-10.3),
    :meth:`attend` (8-9), ``len()``, :meth:`memory` (13), :attr:`segments`
    (10-11), :meth:`save` / :meth:`load` (15).
    """

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        config: Optional[Config] = None,
        backend: str = "cpu",
    ) -> None:
        kv_heads, head_dim = _dims(kv_heads, head_dim)
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise TypeError("config must be a mosaickv.Config (build one with Config(**keys))")
        self._inner = _Cache.mosaic(kv_heads, head_dim, config.to_json(), backend)

    @property
    def config(self) -> Config:
        """The configuration this cache runs with (SPEC section 2)."""
        return Config.from_json(self._inner.config())

    @property
    def segments(self) -> List[SegmentInfo]:
        """Per segment, and in it per KV head, the strategy chosen for it
        (SPEC sections 10-11): r, g, dtype, kept dims, block size, fit loss."""
        return [_segment(s) for s in self._inner.segments()]

    def save(self, path: PathLike) -> None:
        """Writes the cache to ``path`` in the format of SPEC section 15.3, the
        ``cache.mkv`` of ``mosaickv compress`` (``mosaickv attend --cache DIR``
        reads it as ``DIR/cache.mkv``)."""
        self._inner.save(os.fspath(path))

    @classmethod
    def load(cls, path: PathLike, backend: str = "cpu") -> "Cache":
        """Reads a cache file written by :meth:`save` or by ``mosaickv compress``
        (its ``cache.mkv``). Every length, checksum and structural rule of
        SPEC section 15.4 is checked: a damaged file raises
        :class:`BadFormatError` (or :class:`CorruptPackedError`), a missing one
        :class:`IoError`."""
        self = cls.__new__(cls)
        self._inner = _Cache.load(os.fspath(path), backend)
        return self


class _Baseline(_Base):
    """``save`` / ``load`` of a baseline cache (SPEC section 15.5 or 15.6)."""

    _method: str = ""
    _file: str = ""

    def save(self, path: PathLike) -> None:
        """Writes the cache to ``path`` (the file kind is in the class docstring). Loading
        it back with :meth:`load` gives a cache whose :meth:`attend` output is identical
        bit for bit and whose :meth:`memory` is equal. Releases the GIL."""
        self._inner.save(os.fspath(path))

    @classmethod
    def load(cls, path: PathLike, backend: str = "cpu") -> "_Baseline":
        """Reads a file written by this class's :meth:`save`. Every length, checksum and
        rule of SPEC sections 15.4-15.6 is checked: a damaged file, or a file of another
        kind (a ``cache.mkv``, another baseline's file), raises :class:`BadFormatError`
        naming what it found; a missing one :class:`IoError` (both ``OSError``)."""
        self = cls.__new__(cls)
        self._inner = _Cache.load_baseline(os.fspath(path), cls._method, backend)
        return self


class FullCache(_Baseline):
    """Baseline: dense f16 K/V, exact attention over every token (SPEC section 12, Full).

    ``backend="cpu"`` is the optimized ``DenseF16Cache``; ``"reference"`` the f64 oracle.

    Methods: :meth:`prefill`, :meth:`append`, :meth:`attend` (SPEC section 12),
    ``len()``, :meth:`memory` (13), :meth:`save` / :meth:`load`: a dense baseline file
    (SPEC section 15.5, ``dense.mkv``, method ``full``). :meth:`load` also reads the
    ``dense.mkv`` that ``mosaickv compress`` writes (its rows are a full cache's).
    """

    _method = "full"

    def __init__(self, kv_heads: int, head_dim: int, backend: str = "cpu") -> None:
        kv_heads, head_dim = _dims(kv_heads, head_dim)
        self._inner = _Cache.full(kv_heads, head_dim, backend)


class QuestCache(_Baseline):
    """Baseline: Quest (SPEC section 12): dense f16 K/V, pages of 16 tokens with
    per-dim key min/max; ``ceil(B / 16)`` pages attended, ``B = min(n, max(ceil(token_rate
    * n), min_budget_tokens))`` (the budget of SPEC section 8.3; ``min_budget_tokens``
    defaults to MosaicKV's 256, as for the method string ``quest`` in every front end).

    ``backend="cpu"`` is the optimized ``QuestF16Cache``; ``"reference"`` the oracle.

    Methods: :meth:`prefill`, :meth:`append`, :meth:`attend` (SPEC section 12),
    ``len()``, :meth:`memory` (13), :meth:`save` / :meth:`load`: a dense baseline file
    (SPEC section 15.5, ``dense.mkv``) recording method ``quest`` and ``token_rate``.
    """

    _method = "quest"

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        token_rate: float = 0.2,
        backend: str = "cpu",
        min_budget_tokens: int = 256,
    ) -> None:
        kv_heads, head_dim = _dims(kv_heads, head_dim)
        self._inner = _Cache.quest(
            kv_heads, head_dim, float(token_rate), _count(min_budget_tokens, "min_budget_tokens"), backend
        )


class Naive2dCache(_Baseline):
    """Baseline: the paper's naive 2-D strawman (SPEC section 12): per head one
    channel mask of the ``ceil(retention * head_dim)`` highest-energy dims of
    the prompt, then Quest on the masked K/V.

    Only the reference implementation exists (there is no optimized naive 2-D), so
    ``backend="cpu"`` runs it too and :meth:`backend` says ``"reference"``, as ``mosaickv
    attend`` and the engine do. ``retention`` defaults to 0.5 and ``min_budget_tokens`` to
    256, the defaults of the method string ``naive2d`` in every front end.

    Methods: :meth:`prefill`, :meth:`append`, :meth:`attend` (SPEC section 12),
    ``len()``, :meth:`memory` (13), :meth:`save` / :meth:`load`: a baseline cache
    file (SPEC section 15.6) holding the masks and the masked f16 rows.
    """

    _method = "naive2d"

    @classmethod
    def load(cls, path: PathLike, backend: str = "reference") -> "Naive2dCache":
        """Reads a file written by :meth:`save` (SPEC section 15.6); errors as
        :meth:`FullCache.load`."""
        return super().load(path, backend)

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        token_rate: float = 0.2,
        retention: float = 0.5,
        backend: str = "reference",
        min_budget_tokens: int = 256,
    ) -> None:
        kv_heads, head_dim = _dims(kv_heads, head_dim)
        self._inner = _Cache.naive2d(
            kv_heads,
            head_dim,
            float(token_rate),
            float(retention),
            _count(min_budget_tokens, "min_budget_tokens"),
            backend,
        )


class _KvqCache(_Baseline):
    _bits = 0

    def __init__(self, kv_heads: int, head_dim: int, backend: str = "cpu", rotated: bool = True) -> None:
        kv_heads, head_dim = _dims(kv_heads, head_dim)
        if not isinstance(rotated, bool):
            raise TypeError(f"rotated must be a bool, got {type(rotated).__name__}")
        self._inner = _Cache.kvq(kv_heads, head_dim, self._bits, rotated, backend)


class Kvq8Cache(_KvqCache):
    """Baseline: llama.cpp's ``q8_0`` KV cache (SPEC section 12, kvq8).

    Each K and V row is stored as ggml blocks of 32 values: an f16 scale ``d``
    then 32 int8 quants, ``x = q * d`` (34 bytes per 32 values); ``head_dim`` must
    be a multiple of 32 (:class:`InvalidConfigError` otherwise). Attention is
    ggml's CPU flash-attention row, all f32: the query is quantized to ``q8_0``
    too, then an online softmax over every token. A block whose scale would not
    be a finite f16 raises :class:`NonFiniteError`.

    ``rotated=True`` (the default) is llama.cpp's cache as it runs today (since 2026-04,
    PR 21038): each head's K rows and queries are rotated by a normalized Hadamard matrix
    (blocks of the largest power of two >= 64 dividing ``head_dim``), V rows by blocks of 64,
    before quantization, and the output is rotated back; ``rotated=False`` is llama.cpp
    before it (``kvq8-norot``). Where 64 does not divide ``head_dim`` nothing is rotated, as in
    llama.cpp. A saved file records the rotation and :meth:`load` follows it.

    ``backend="cpu"`` is the optimized cache, ``"reference"`` the readable one
    (the same output bits).

    Methods: :meth:`prefill`, :meth:`append`, :meth:`attend` (SPEC section 12),
    ``len()``, :meth:`memory` (13: the quants as ``values``, the f16 scales as
    ``block_meta``), :meth:`save` / :meth:`load`: a baseline cache file (SPEC
    section 15.6) holding the ggml blocks.
    """

    _method = "kvq8"
    _bits = 8


class Kvq4Cache(_KvqCache):
    """Baseline: llama.cpp's ``q4_0`` KV cache (SPEC section 12, kvq4).

    As :class:`Kvq8Cache`, with ``q4_0`` blocks: an f16 scale ``d`` then 16 bytes
    of nibbles (element ``j`` in the low nibble of byte ``j``, element ``j + 16``
    in its high nibble), ``x = (q - 8) * d`` (18 bytes per 32 values). The query
    is still quantized to ``q8_0``, as ggml does.

    Methods: :meth:`prefill`, :meth:`append`, :meth:`attend` (SPEC section 12),
    ``len()``, :meth:`memory` (13), :meth:`save` / :meth:`load` (SPEC section 15.6).
    """

    _method = "kvq4"
    _bits = 4


class QuestSinkCache(_Baseline):
    """Baseline: Quest-sink (SPEC section 12): Quest's pages under MosaicKV's sink, update
    buffer and token budget. Only the reference implementation exists, so it runs on any
    ``backend`` and :meth:`backend` says ``"reference"``. Built by :func:`from_method`
    (``"quest-sink"``, ``"quest-sink:rate=0.1:sink=0"``); it has no file format."""

    _method = "quest-sink"


class TurboQuantCache(_Baseline):
    """Baseline: vLLM's TurboQuant KV cache (SPEC section 12, ``--kv-cache-dtype
    turboquant_<preset>``): keys normalized, Hadamard-rotated and rounded to a Lloyd-Max
    codebook of N(0, 1/head_dim) (3 or 4 bits, the norm in f16; ``k8v4``: FP8 keys), values
    uniform per vector (3 or 4 bits, f16 scale and minimum), in vLLM's slot layout. On
    ``backend="cpu"`` the optimized cache, on ``"reference"`` the reference's (the same slots
    and the same output bits). Built by :func:`from_method` (``"turboquant:4bit_nc"``,
    ``"turboquant:k8v4"``, ...); no file format."""

    _method = "turboquant"


_CLASSES = {
    "mosaic": None,
    "mosaic-ref": None,
    "full": FullCache,
    "quest": QuestCache,
    "quest-sink": QuestSinkCache,
    "naive2d": Naive2dCache,
    "kvq8": Kvq8Cache,
    "kvq4": Kvq4Cache,
    "kvq8-norot": Kvq8Cache,
    "kvq4-norot": Kvq4Cache,
    "turboquant": TurboQuantCache,
}


def from_method(method: str, kv_heads: int, head_dim: int, backend: str = "cpu") -> "_Base":
    """The cache a method string names, built by the method registry every front end uses
    (the engine's ``--method``, ``mosaickv attend --method``, ``mosaickv serve``): the same
    string gives the same cache, and the same attention output bit for bit.

    ``method``: ``full``, ``quest``, ``quest-sink``, ``naive2d``, ``kvq8``, ``kvq4``,
    ``mosaic``, ``mosaic-ref``, each with ``:key=value`` overrides (``quest:rate=0.1``,
    ``naive2d:ret=0.25``, ``mosaic:kloss=0.02:vloss=0.05``, ``mosaic:ret=0.5:g=2``; every key
    is in the README). A bad string raises :class:`InvalidConfigError` naming what is wrong.
    Returns an instance of the matching class (:class:`Cache` for ``mosaic``)."""
    kv_heads, head_dim = _dims(kv_heads, head_dim)
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    inner = _Cache.method(kv_heads, head_dim, method, backend)
    cls = _CLASSES.get(method.split(":")[0].strip()) or Cache
    self = cls.__new__(cls)
    self._inner = inner
    return self


def _config_from_dict(keys: Dict[str, Any]) -> "Config":
    return Config(**keys)
