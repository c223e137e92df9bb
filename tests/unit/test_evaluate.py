"""Periodic eval: schedule, mean@k / pass@k, config checks (the engine part runs end to end in
tests/integration/test_observability_e2e.py)."""

from __future__ import annotations

import threading

import pytest

from relax_slurm.config.evaluation import EvalConfig
from relax_slurm.errors import ConfigError
from relax_slurm.evaluate import EvalSchedule, eval_due, k_metrics


class GatedEvaluator:
    """run() blocks until the test opens the gate; counts its calls."""

    def __init__(self) -> None:
        self.gate, self.calls, self.closed = threading.Event(), 0, False

    def run(self) -> dict:
        self.calls += 1
        assert self.gate.wait(10)
        return {"eval/x/mean@1": float(self.calls)}

    def close(self) -> None:
        self.closed = True


def test_sync_schedule_evaluates_inline_on_the_due_steps():
    ev = GatedEvaluator()
    ev.gate.set()
    sched = EvalSchedule(ev, every=2, total_steps=3, background=False)
    # rank 0 announces a version after an inline eval of it, before any other step's row
    assert [sched.inline(d) for d in (1, 2, 3)] == [False, True, True]
    rows = [sched.after_step(d) for d in (1, 2, 3)]
    assert rows == [{}, {"eval/x/mean@1": 1.0, "policy/eval_version": 2},
                    {"eval/x/mean@1": 2.0, "policy/eval_version": 3}]


def test_async_schedule_runs_aside_skips_overlaps_and_waits_at_the_end():
    ev = GatedEvaluator()
    sched = EvalSchedule(ev, every=1, total_steps=4, background=True)
    assert not any(sched.inline(d) for d in (1, 2, 3, 4))  # never holds the announcement
    assert sched.after_step(1) == {}  # started in the background; training goes on
    assert sched.after_step(2) == {}  # still running: version 2's eval is skipped
    ev.gate.set()
    sched.pending[1].result(timeout=10)
    assert sched.after_step(3) == {"eval/x/mean@1": 1.0, "policy/eval_version": 1}
    sched.pending[1].result(timeout=10)  # version 3's eval is done before step 4 ends
    # the last step starts version 4's eval and waits for it: the final row has it
    assert sched.after_step(4) == {"eval/x/mean@1": 3.0, "policy/eval_version": 4}
    assert ev.calls == 3
    sched.close()
    assert ev.closed


def test_eval_runs_every_n_steps_and_after_the_last():
    assert [d for d in range(1, 8) if eval_due(3, d, 7)] == [3, 6, 7]
    assert not any(eval_due(0, d, 7) for d in range(1, 8))


def test_mean_and_pass_at_k():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    assert k_metrics(rewards, 4) == {"mean@4": pytest.approx(5 / 12), "pass@4": pytest.approx(2 / 3)}
    assert k_metrics([[0.5]], 1) == {"mean@1": 0.5, "pass@1": 0.0}  # partial credit never passes


def test_eval_config_names_the_fix():
    with pytest.raises(ConfigError, match="eval.datasets"):
        EvalConfig(every=5)
    with pytest.raises(ConfigError, match="eval.temperature"):
        EvalConfig(every=5, datasets=["t.jsonl"], n_samples=4)
    EvalConfig(every=5, datasets=["t.jsonl"], n_samples=4, temperature=0.6)
