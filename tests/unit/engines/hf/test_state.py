"""The hf engine's state object: what /generate is refused for, when memory may be released,
what /server_info reports (no model, no threads)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from relax_slurm.engines.hf.batch import PendingRequest, Row
from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.parsing import BadRequest, NotServing, SamplingSpec
from relax_slurm.engines.hf.state import EngineState


def row(out_ids: list[int] = (), held: bool = False) -> Row:
    r = Row([4, 5], SamplingSpec(), False, PendingRequest(Future(), [None], 1), 0)
    r.out_ids = list(out_ids)
    r.held_in_place = held
    return r


def test_generate_is_refused_while_memory_is_released_or_weights_are_partial():
    state = EngineState()
    state.check_serving()
    state.released = {"weights"}
    with pytest.raises(BadRequest, match="resume_memory_occupation"):
        state.check_serving()
    state.released = set()
    state.partial_weights = True
    with pytest.raises(NotServing, match="midway"):
        state.check_serving()


def test_idle_or_paused_counts_an_in_place_batch_as_running():
    state = EngineState()
    assert state.idle_or_paused()
    state.pending.append(row())
    assert not state.idle_or_paused()  # queued and not paused: it would run
    state.paused = True
    assert state.idle_or_paused()  # a paused queue does not count ...
    state.pending.append(row(held=True))
    assert not state.idle_or_paused() and state.held_in_place()  # ... its in-place rows do


def test_status_reports_queue_batch_and_pause_mode():
    state = EngineState(paused=True, interrupt="retract", session=True)
    state.pending.extend([row(held=True), row()])
    state.running = [row([7, 8, 9])]
    assert state.status() == {
        "paused": True, "pause_mode": "retract", "queued_sequences": 2, "running_sequences": 1,
        "running_tokens": 3, "held_in_place": 1, "weight_update_session": True,
        "partial_weights": False, "memory_released": []}
    state.paused = False  # an abort_all's interrupt is no pause mode
    state.interrupt = "abort"
    assert state.status()["pause_mode"] is None


class SignalingCondition(threading.Condition):
    """A Condition that says when a thread starts waiting on it (and so released its lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_an_abort_all_during_the_batching_wait_leaves_the_generation_thread_alive(tiny_model_dir):
    """The batch loop waits batch_wait_ms for more sequences with the queue's lock released;
    an abort_all then empties the queue. The loop must start no batch (it took the first row
    of the empty queue and its thread died: every later request timed out), and the aborted
    request ends with finish_reason abort. Found by the engine contract test against SGLang."""
    engine = HFEngine(str(tiny_model_dir), None, "float32", "cpu", 8, 60_000.0, "0", 30.0)
    engine._cond = cond = SignalingCondition()  # before the loop's thread exists: not started
    future = engine.submit([[5, 6, 7]], [SamplingSpec(max_new_tokens=4)], [False])
    batch: list = []
    loop = threading.Thread(target=lambda: batch.append(engine._next_batch()))
    loop.start()
    assert cond.waiting.wait(timeout=60)  # inside the 60 s batching wait, lock released
    engine.abort_all()
    with cond:
        cond.notify_all()  # end the wait now, as a new request would
    loop.join(timeout=60)
    assert not loop.is_alive() and batch == [[]]  # no batch, no exception
    [item] = future.result(timeout=10)
    assert item["meta_info"]["finish_reason"]["type"] == "abort"
