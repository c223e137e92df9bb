"""trainer.stop_at: the reward target's arithmetic and its refusals (the end-to-end stop is in
tests/integration/test_tiny_e2e.py and the learning tests that end on it)."""

from __future__ import annotations

import numpy as np
import pytest

from relax_slurm.config.trainer import StopAtConfig
from relax_slurm.errors import ConfigError
from relax_slurm.samples import Sample
from relax_slurm.metrics.summary import first_reached, reached
from relax_slurm.trainer.stop_at import RewardTarget, batch_reward


def group(*rewards: float) -> list[Sample]:
    one = np.ones(1, dtype=np.int64)
    return [Sample(prompt_id="p", group_id=0, prompt_ids=one, response_ids=one,
                   loss_mask=one, rollout_logprobs=np.zeros(1, dtype=np.float32), reward=r)
            for r in rewards]


def test_reached_needs_a_full_window_at_or_above_the_target():
    assert reached([0.9, 0.9], 0.5, window=3) is None  # too few steps yet
    assert reached([0.0, 0.5, 0.5, 0.5], 0.5, window=3) == 0.5  # at the target: reached
    assert reached([0.9, 0.9, 0.0], 0.7, window=3) is None  # the mean, not any one step
    assert reached([0.1, 0.7], 0.7, window=1) == pytest.approx(0.7)


def test_first_reached_is_the_step_count_at_the_first_full_window_at_the_target():
    assert first_reached([0.0, 0.6, 0.6, 0.6, 0.0], 0.5, window=2) == 3  # steps 2-3
    assert first_reached([0.0, 0.6, 0.6], 0.5, window=3) is None  # (0.0 + 0.6 + 0.6) / 3
    assert first_reached([0.9], 0.5, window=1) == 1
    assert first_reached([], 0.5, window=1) is None


def test_batch_reward_is_the_mean_over_every_sample_of_the_step():
    assert batch_reward([group(1.0, 0.0), group(1.0, 1.0)]) == pytest.approx(0.75)


def test_the_target_counts_each_step_once_and_names_the_steps_it_averaged():
    target = RewardTarget(StopAtConfig(reward=0.5, steps=2))
    target.note(1, [group(0.0, 0.0)])
    assert target.stop_reason() is None
    target.note(2, [group(1.0, 0.0)])
    target.note(2, [group(1.0, 1.0)])  # a second call for the same step (a resent push) counts once
    assert target.stop_reason() is None  # (0.0 + 0.5) / 2
    target.note(3, [group(1.0, 1.0)])
    reason = target.stop_reason()
    assert reason == ("trainer.stop_at.reward=0.5 reached at step 3: mean reward 0.7500 over "
                      "steps 2-3")


def test_no_target_never_stops():
    target = RewardTarget(StopAtConfig())
    for step in range(1, 5):
        target.note(step, [group(1.0)])
    assert not target.active and target.stop_reason() is None and target.rewards == []


def test_a_window_of_no_steps_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.stop_at.steps=0: must be >= 1"):
        StopAtConfig(steps=0)
