"""Advantages and losses (pure torch). The trainer calls these and never branches on a name."""

from relax_slurm.algos.grpo import (
    group_advantages,
    grpo_policy_loss,
    ppo_clip_token_loss,
    reduction_weights,
    truncated_is_weights,
)

__all__ = [
    "group_advantages",
    "grpo_policy_loss",
    "ppo_clip_token_loss",
    "reduction_weights",
    "truncated_is_weights",
]
