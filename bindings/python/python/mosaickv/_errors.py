"""The exceptions of mosaickv: one class per kind of the Rust ``MosaicError``
(SPEC.md section 14), all under :class:`MosaicError`.

The message is the one line ``mosaickv`` (the CLI) prints after ``mosaickv: error:``.
Shapes, values and configuration derive from :class:`ValueError`; files
(``IoError``, ``BadFormatError``, ``CorruptPackedError``) from :class:`OSError`.
Every operation checks its input before it changes anything, so after any of
these the cache is exactly as it was.
"""


class MosaicError(Exception):
    """Base class of every error mosaickv raises (Rust ``MosaicError``, SPEC.md section 14)."""


class NonFiniteError(MosaicError, ValueError):
    """NaN or +-Inf in an input, or a value whose stored f16 form would overflow
    (a K/V row norm beyond 65472, SPEC.md section 14)."""


class ShapeMismatchError(MosaicError, ValueError):
    """An array has the wrong rank or shape for the call (SPEC.md section 1)."""


class GroupSizeNotDivisorError(MosaicError, ValueError):
    """``head_dim`` is not a multiple of a group size ``g`` of the configuration."""


class RetentionOutOfRangeError(MosaicError, ValueError):
    """A retained count ``r`` outside ``g..=kept_dims`` (SPEC.md section 11)."""


class EmptyCacheError(MosaicError, ValueError):
    """Attention was asked of a cache with no tokens."""


class GqaMismatchError(MosaicError, ValueError):
    """``q_heads`` is not a positive multiple of ``kv_heads`` (SPEC.md section 1)."""


class UnknownConfigKeyError(MosaicError, ValueError):
    """A configuration names a key SPEC.md section 2 does not have."""


class InvalidConfigError(MosaicError, ValueError):
    """A configuration value (or a backend name) is out of its allowed range."""


class AlreadyPrefilledError(MosaicError, ValueError):
    """``prefill`` on a cache that already holds tokens."""


class CorruptPackedError(MosaicError, OSError):
    """Packed records in a file that break SPEC.md section 6."""


class BadFormatError(MosaicError, OSError):
    """A file that is not a valid MosaicKV cache of this version (SPEC.md section 15.4):
    magic, version, checksum, truncation or structure."""


class IoError(MosaicError, OSError):
    """Reading or writing a file failed; the message names the path."""


class BackendUnavailableError(MosaicError, RuntimeError):
    """The backend cannot run here (no CUDA in this build, no GPU, no driver, ...)."""


class DtypeError(MosaicError, TypeError, ValueError):
    """An input that is not a numpy array of float32 or float16 (the binding's own
    check, like the CLI's refusal of other ``.npy`` dtypes)."""


__all__ = [name for name, obj in dict(globals()).items() if isinstance(obj, type) and issubclass(obj, MosaicError)]
