"""CISPO (MiniMax-M1, arXiv 2506.13585): GRPO's advantages, and a policy gradient weighted by
the clipped importance ratio instead of a clipped objective. Shapes: [N, T] tokens.

    loss = -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp

The ratio only weights the token (its gradient stops), so no token's gradient is dropped the
way PPO's clip drops tokens once their ratio leaves the band: the rare tokens that carry a
reasoning step ("wait", "however") keep contributing after their probability jumped. The paper
sets no lower bound in practice (eps_clip = 1: the weight's floor is 0) and tunes the upper one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_slurm.algos.grpo import group_advantages
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import CispoParams


def clipped_is_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                          loss_mask: Tensor | None, p: CispoParams) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss and a 0/1 map of where the weight was clipped."""
    high = p.eps_clip if p.eps_clip_high is None else p.eps_clip_high
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(1.0 - p.eps_clip, 1.0 + high)
    return -weight * advantages * logp, (weight != ratio).float()


register(Algorithm(name="cispo", advantages=group_advantages, token_loss=clipped_is_token_loss))
