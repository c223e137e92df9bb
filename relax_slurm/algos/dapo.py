"""DAPO: GRPO advantages and the PPO clip, with clip-higher and token-mean reduction (its YAML),
plus two data-side pieces the rollout applies before training (torch-free, in
relax_slurm/rewards/shaping.py, re-exported here):

- dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and only
  dilutes the batch, so it is dropped and more prompts are sampled to refill the batch;
- soft overlong punishment: a reward penalty growing linearly over the last `buffer_len` tokens
  before the generation limit, so that length is discouraged gradually instead of a cliff at
  truncation.
"""

from __future__ import annotations

from relax_slurm.algos.grpo import group_advantages, ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register
# torch-free, so that the rollout worker applies them without importing torch
from relax_slurm.rewards.shaping import is_informative_group, overlong_penalty

__all__ = ["is_informative_group", "overlong_penalty"]


register(Algorithm(name="dapo", advantages=group_advantages, token_loss=ppo_clip_token_loss))
