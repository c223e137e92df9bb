"""Periodic eval: schedule, mean@k / pass@k, config checks (the engine part runs end to end in
tests/integration/test_observability_e2e.py)."""

from __future__ import annotations

import pytest

from relax_slurm.config.schema import EvalConfig
from relax_slurm.errors import ConfigError
from relax_slurm.rollout.evaluate import eval_due, k_metrics


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
