"""RLOO: each sample's baseline is the mean reward of the other samples of its group.

A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)). The baseline does not include
the sample itself, so the estimate is unbiased; no std division. The loss is the PPO clip.
"""

from __future__ import annotations

from torch import Tensor

from relax_slurm.algos.grpo import ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import NoParams


def leave_one_out_advantages(rewards: Tensor, p: NoParams) -> Tensor:
    """r_i minus the mean of the other G-1 rewards of its group, [B, G]; needs G >= 2."""
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError(f"algo=rloo needs >= 2 samples per prompt, got {g}: "
                         "raise rollout.n_samples_per_prompt")
    return (rewards - rewards.mean(dim=-1, keepdim=True)) * (g / (g - 1))


register(Algorithm(name="rloo", advantages=leave_one_out_advantages,
                   token_loss=ppo_clip_token_loss))
