"""GRPO: group-normalised advantages and the PPO-clip loss. Shapes: [B, G] groups, [N, T] tokens."""

from __future__ import annotations

from torch import Tensor

from relax_slurm.algos.common import ppo_clip
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import ClipParams, GroupParams

ADV_EPS = 1e-6


def group_advantages(rewards: Tensor, p: GroupParams) -> Tensor:
    """Advantage of each sample relative to its group: (r - mean) / (std + 1e-6).

    rewards: [B, G]. With `p.std_normalize=False` only the mean is subtracted (Dr.GRPO), which
    keeps easy and hard prompts on the same scale instead of amplifying near-constant groups.
    Uses the unbiased std (as torch.std and Relax/verl do); a group of identical rewards gets 0.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not p.std_normalize:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + ADV_EPS)


def ppo_clip_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                        loss_mask: Tensor | None, p: ClipParams) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss on ratio = exp(logp - old_logp) (dual-clip with `eps_clip_c`);
    see `common.ppo_clip`."""
    return ppo_clip(logp - old_logp, advantages, p.eps_clip, p.eps_clip_high, p.eps_clip_c)


register(Algorithm(name="grpo", advantages=group_advantages, token_loss=ppo_clip_token_loss))
