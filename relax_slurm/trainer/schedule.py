"""Learning-rate schedules: the lr factor at an optimizer step, as a pure function.

Linear warm-up over `warmup_steps`, then `constant`, or a `cosine`/`linear` decay to
`min_lr_ratio` x lr at `total_steps` (the trainer passes `trainer.lr_decay_steps` or
`trainer.total_steps`; as Megatron's lr_decay_style/lr_decay_iters and verl's
lr_scheduler_type). RL runs at a fixed lr keep moving once the reward saturates; decaying
it lets a run settle, which matters most off-policy (max_staleness > 0).
"""

from __future__ import annotations

import math

from relax_slurm.config.trainer import SCHEDULES  # the config validates the name: one list


def lr_factor(step: int, *, total_steps: int, warmup_steps: int = 0,
              schedule: str = "constant", min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        decay = 1.0 - progress
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; use one of {SCHEDULES}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
