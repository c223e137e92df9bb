"""REINFORCE++ advantages: rewards whitened over the whole batch instead of per group.

- reinforce_plus_plus: A = (r - mean_batch(r)) / (std_batch(r) + 1e-6). No per-prompt baseline,
  so it also works with one sample per prompt; the batch statistics keep the scale stable.
- reinforce_plus_plus_baseline: subtract each group's mean first (a per-prompt baseline, as
  GRPO), then divide by the std of those centred rewards over the batch. Unlike GRPO, a group
  of near-identical rewards is not blown up by its own tiny std.
Statistics are per sample (not per token), and the KL to a reference model goes in the loss
(`algo.kl_loss_coef`) rather than into the reward. The loss is the PPO clip.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_slurm.algos.grpo import ADV_EPS, ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import NoParams


def _batch_std(x: Tensor) -> Tensor:
    # unbiased, like torch.std; a batch of one sample has no spread
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def batch_whitened_advantages(rewards: Tensor, p: NoParams) -> Tensor:
    """(r - batch mean) / (batch std + 1e-6) over all B*G rewards, [B, G]."""
    return (rewards - rewards.mean()) / (_batch_std(rewards) + ADV_EPS)


def group_baseline_advantages(rewards: Tensor, p: NoParams) -> Tensor:
    """(r - group mean) / (batch std of the centred rewards + 1e-6), [B, G]."""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return centred / (_batch_std(centred) + ADV_EPS)


register(Algorithm(name="reinforce_plus_plus", advantages=batch_whitened_advantages,
                   token_loss=ppo_clip_token_loss))
register(Algorithm(name="reinforce_plus_plus_baseline", advantages=group_baseline_advantages,
                   token_loss=ppo_clip_token_loss))
