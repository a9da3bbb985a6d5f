"""The runner's rows reach the backend: `batch.install` wraps vLLM's `_update_states`, which
publishes each step's request ids in row order and the requests that ended."""

import types

import pytest

from mosaickv_vllm import batch


def test_ended_since_reports_each_end_once_per_reader():
    batch.record(["a", "b"], [1, 1], finished=set(), preempted=None)
    seen, gone = batch.ended_since(0)
    batch.record(["b"], [1], finished={"a"}, preempted=None)
    batch.record(["c"], [7], finished=set(), preempted={"b"})
    assert batch.rows_for([7]) == ["c"]
    seen2, gone2 = batch.ended_since(seen)
    assert gone2 == {"a", "b"} and seen2 == seen + 2
    assert batch.ended_since(seen2)[1] == set()


def test_install_wraps_update_states_once():
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    calls = []

    def fake_update_states(self, scheduler_output):
        calls.append(scheduler_output)
        return "deferred"

    saved = gmr.GPUModelRunner._update_states
    gmr.GPUModelRunner._update_states = fake_update_states
    try:
        assert batch.install() and batch.install()  # the second call does not wrap again
        runner = types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=["r2", "r0", "r1", None], num_reqs=3))
        out = gmr.GPUModelRunner._update_states(
            runner, types.SimpleNamespace(finished_req_ids={"old"}, preempted_req_ids=None,
                                          num_scheduled_tokens={"r0": 5, "r1": 1, "r2": 1}))
        assert out == "deferred" and len(calls) == 1
        assert batch.rows_for([1, 5, 1]) == ["r2", "r0", "r1"]
        assert "old" in batch.ended_since(0)[1]
    finally:
        gmr.GPUModelRunner._update_states = saved


def test_rows_of_another_step_are_not_used():
    batch.record(["x", "y"], [1, 300], finished=set(), preempted=None)
    assert batch.rows_for([1, 300]) == ["x", "y"]
    assert batch.rows_for([1, 1]) is None  # other token counts: not the published step
    assert batch.rows_for([1]) is None  # another row count
    assert batch.rows_for([1, 300, 1]) is None
