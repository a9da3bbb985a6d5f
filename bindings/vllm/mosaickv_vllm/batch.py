"""Which request each row of a step's attention metadata belongs to.

vLLM's attention metadata carries no request ids, and the first physical block of a row's
block table, phase 1's key, stops naming one request once blocks are freed behind a window
(docs/VLLM.md, section 11). The model runner knows: right after its ``_update_states``,
``input_batch.req_ids[:num_reqs]`` is the row order of the step's metadata (the batch is
condensed and reordered inside it), and the scheduler's output names the requests that
finished or were preempted. ``install`` wraps that method (vLLM 0.32's V1 runner, which its CPU
worker uses) to publish both here; the backend keys its caches by request id when the rows are
known, and frees a request's caches when it finishes or is preempted instead of when it is
merely not scheduled in a step.
"""

from __future__ import annotations

import collections
import threading

_lock = threading.Lock()
#: The latest step's rows: request ids in the metadata's order, and the tokens the scheduler
#: gave each (one assignment, so a reader never sees the ids of one step with another's counts).
current: tuple[list[str], list[int]] = ([], [])
#: Steps recorded so far (a forward pass reads the rows of the latest one).
step = 0
#: ``(step, ids)`` of requests that ended (finished or preempted) at each recent step.
ended: collections.deque = collections.deque(maxlen=4096)


def record(req_ids, tokens, finished, preempted) -> None:
    """Publishes one step's row order with each row's scheduled tokens, and the requests that
    ended before it."""
    global current, step
    with _lock:
        step += 1
        current = (list(req_ids), [int(t) for t in tokens])
        gone = set(finished or ()) | set(preempted or ())
        if gone:
            ended.append((step, frozenset(gone)))


def rows_for(query_lens: list[int]) -> list[str] | None:
    """The request ids of a forward pass whose rows have ``query_lens`` tokens, or None when the
    latest published step is not this pass (another row count or other token counts: a dummy
    run, a runner that does not publish), so that rows are never keyed by a stale step."""
    ids, tokens = current
    return ids if tokens == list(query_lens) and len(ids) == len(tokens) else None


def ended_since(seen: int) -> tuple[int, set[str]]:
    """The requests that ended after step ``seen``, and the latest step."""
    with _lock:
        out: set[str] = set()
        for s, ids in ended:
            if s > seen:
                out |= ids
        return step, out


def install() -> bool:
    """Wraps the V1 model runner's ``_update_states`` once; False where it is not there (the
    backend then keys rows by their first block, as phase 1 did)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    original = getattr(GPUModelRunner, "_update_states", None)
    if original is None:
        return False
    if getattr(original, "_mosaickv_rows", False):
        return True

    def _update_states(self, scheduler_output):
        out = original(self, scheduler_output)
        ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        scheduled = scheduler_output.num_scheduled_tokens
        record(ids, [scheduled.get(r, 0) for r in ids], scheduler_output.finished_req_ids,
               getattr(scheduler_output, "preempted_req_ids", None))
        return out

    _update_states._mosaickv_rows = True
    GPUModelRunner._update_states = _update_states
    return True
