"""MosaicKV inside vLLM's CPU build: phase 1 of docs/VLLM.md.

vLLM loads this through its ``vllm.general_plugins`` entry point in every process (API
server, engine core, workers). ``register`` re-registers ``AttentionBackendEnum.CPU_ATTN``
(the only backend vLLM's CPU platform returns) to :class:`mosaickv_vllm.backend.MosaicKVBackend`,
a subclass of vLLM's own CPU attention backend whose decode attention runs on a MosaicKV cache.

The method comes from the environment variable ``MOSAICKV_VLLM``: any method string of the
project's registry (``mosaic``, ``mosaic:kloss=0.02``, ``full``, ``kvq4``...). Unset, empty or
``off``, the plugin does nothing and vLLM runs its own CPU attention: the override is global to
every CPU run in the environment, so it is never on by default.
"""

from __future__ import annotations

import os

METHOD_ENV = "MOSAICKV_VLLM"
BACKEND_PATH = "mosaickv_vllm.backend.MosaicKVBackend"



def method() -> str | None:
    """The method this process runs, or None when the plugin is switched off."""
    m = os.environ.get(METHOD_ENV, "").strip()
    return None if m.lower() in ("", "off") else m


def register() -> None:
    """vLLM's plugin hook. An invalid method string raises here (vLLM propagates what a
    registered function raises), so a bad setting stops the server at start-up instead of
    serving with vLLM's own cache."""
    from vllm.logger import init_logger

    logger = init_logger("vllm.plugins.mosaickv")
    m = method()
    if m is None:
        logger.info("mosaickv_vllm: %s unset or off, vLLM's own CPU attention is used", METHOD_ENV)
        return
    import mosaickv

    # Validate the string now, with a small shape every method accepts.
    mosaickv.from_method(m, 1, 64)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    from . import batch

    rows = batch.install()
    logger.info("mosaickv_vllm: CPU_ATTN -> %s, method %r, sequences keyed by %s", BACKEND_PATH, m,
                "request id" if rows else "first block (the V1 runner's _update_states is absent)")
