"""Pieces shared by several algorithms: the PPO clip and importance weights."""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_is_weights(train_logp: Tensor, rollout_logp: Tensor, clip: float | None) -> Tensor:
    """Per-token importance weights exp(train - rollout) capped at `clip` (no gradient).

    Corrects for the engine and the trainer computing slightly different distributions (and, in
    async mode, for older engine weights) without letting a rare token dominate the gradient.
    """
    if clip is None:
        return torch.ones_like(train_logp)
    return torch.exp(train_logp.detach() - rollout_logp).clamp(max=clip)


def ppo_clip(
    log_ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and a 0/1 map of where the clipped term wins.

    loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()
