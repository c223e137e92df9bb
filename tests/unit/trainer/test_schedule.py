"""lr schedules: warm-up, then constant / cosine / linear decay to min_lr_ratio."""

from __future__ import annotations

import math

import pytest
import torch

from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.model import build_optimizer
from relax_slurm.trainer.schedule import lr_factor


def test_warmup_then_constant():
    f = [lr_factor(s, total_steps=10, warmup_steps=4) for s in range(10)]
    assert f == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule, mid", [("cosine", 0.55), ("linear", 0.55)])
def test_decay_reaches_min_at_total_steps(schedule, mid):
    kw = dict(total_steps=12, warmup_steps=2, schedule=schedule, min_lr_ratio=0.1)
    assert lr_factor(1, **kw) == 1.0  # the last warm-up step
    assert lr_factor(2, **kw) == 1.0  # decay starts from the full lr
    assert lr_factor(7, **kw) == pytest.approx(mid)  # half way: 0.1 + 0.9 * 0.5
    assert lr_factor(12, **kw) == pytest.approx(0.1)
    assert lr_factor(50, **kw) == pytest.approx(0.1)  # past total_steps it stays at the floor
    values = [lr_factor(s, **kw) for s in range(2, 13)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_shape():
    kw = dict(total_steps=100, schedule="cosine")
    assert lr_factor(25, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def lrs_of_a_run(cfg: TrainerConfig) -> list[float]:
    """The lr of each optimizer step of a `cfg.total_steps` run, as the trainer steps it."""
    opt, sched = build_optimizer(torch.nn.Linear(2, 1), cfg)
    seen = []
    for _ in range(cfg.total_steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_optimizer_follows_the_schedule():
    cfg = TrainerConfig(lr=1.0, total_steps=4, lr_schedule="linear", min_lr_ratio=0.0)
    assert lrs_of_a_run(cfg) == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_bad_schedule_names_the_key():
    with pytest.raises(ConfigError, match="trainer.lr_schedule='cosin'"):
        TrainerConfig(lr_schedule="cosin")
    with pytest.raises(ConfigError, match="trainer.min_lr_ratio"):
        TrainerConfig(min_lr_ratio=2.0)


def test_lr_decay_steps_fixes_the_horizon():
    """A 4-step run of a schedule decaying over 8 steps follows the 8-step run's first 4."""
    short = TrainerConfig(lr=1.0, total_steps=4, lr_decay_steps=8, lr_schedule="linear")
    assert lrs_of_a_run(short) == pytest.approx([1.0, 0.875, 0.75, 0.625])
