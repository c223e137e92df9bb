"""SAPO: GRPO advantages with a soft, temperature-controlled gate instead of the hard PPO clip.

f(r) = (4 / tau) * sigmoid(tau * (r - 1)) has slope 1 at r = 1 (the on-policy gradient is the
plain policy gradient) and flattens smoothly as r leaves 1, so off-policy tokens are damped
rather than cut. Negative advantages use a slightly larger tau (faster damping): pushing a
token's probability down spreads mass over the whole vocabulary and is less stable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_slurm.algos.grpo import group_advantages
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import SapoParams


def soft_gate_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                         loss_mask: Tensor | None, p: SapoParams) -> tuple[Tensor, Tensor]:
    """Per-token loss -f(r) * A with tau = tau_pos where A > 0, else tau_neg; nothing is clipped."""
    ratio = torch.exp(logp - old_logp)
    tau = torch.where(advantages > 0, torch.full_like(ratio, p.tau_pos),
                      torch.full_like(ratio, p.tau_neg))
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return -gate * advantages, torch.zeros_like(ratio)


register(Algorithm(name="sapo", advantages=group_advantages, token_loss=soft_gate_token_loss))
