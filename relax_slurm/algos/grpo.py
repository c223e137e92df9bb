"""GRPO math: group-normalised advantages and the PPO-clip policy loss. Pure torch, no I/O.

Shapes: `[G, n]` is groups x samples per group; `[B, T]` is samples x response-aligned tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-6


def group_advantages(rewards: Tensor, std_normalize: bool = True) -> Tensor:
    """Advantage of each sample relative to its group: (r - mean) / (std + 1e-6).

    rewards: [G, n]. With `std_normalize=False` only the mean is subtracted (Dr.GRPO), which
    keeps easy and hard prompts on the same scale instead of amplifying near-constant groups.
    Uses the unbiased std (as torch.std and Relax/verl do); a group of identical rewards gets 0.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not std_normalize:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + ADV_EPS)


def truncated_is_weights(train_logp: Tensor, rollout_logp: Tensor, clip: float | None) -> Tensor:
    """Per-token importance weights exp(train - rollout) capped at `clip` (no gradient).

    Corrects for the engine and the trainer computing slightly different distributions (and, in
    async mode, for older engine weights) without letting a rare token dominate the gradient.
    """
    if clip is None:
        return torch.ones_like(train_logp)
    return torch.exp(train_logp.detach() - rollout_logp).clamp(max=clip)


def ppo_clip_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and a 0/1 map of where the clipped term wins. All [B, T].

    loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


def reduction_weights(masks: list[Tensor], reduction: str) -> list[Tensor]:
    """Per-token weights over a whole batch so that sum(w * token_loss) is the batch loss.

    Computed once over the full batch (before it is split across ranks) so that the loss is the
    same however samples are sharded or micro-batched.
    - seq_mean_token_mean: mean over a sample's tokens, then mean over samples;
    - token_mean: mean over every token of the batch;
    - token_sum: plain sum over tokens, divided by the number of samples (a constant scale, as
      Dr.GRPO, so longer answers are not down-weighted).
    """
    n = len(masks)
    if reduction == "seq_mean_token_mean":
        return [m / (m.sum().clamp(min=1.0) * n) for m in masks]
    if reduction == "token_mean":
        total = sum(float(m.sum()) for m in masks)
        return [m / max(total, 1.0) for m in masks]
    if reduction == "token_sum":
        return [m / n for m in masks]
    raise ValueError(f"unknown loss reduction {reduction!r}")


def grpo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    tis_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss on one micro-batch: sum(weights * tis * ppo_clip_loss). All inputs [B, T].

    `weights` come from `reduction_weights` (zero on prompt, padding and observation tokens), so
    summing the micro-batch losses of every rank gives the batch loss. Returns the loss and
    mask-weighted sums for metrics (clipped tokens, |train - rollout| log-prob gap, token count)
    that the caller all-reduces and divides.
    """
    token_loss, clipped = ppo_clip_token_loss(logp, old_logp, advantages, eps_clip, eps_clip_high)
    tis = truncated_is_weights(old_logp, rollout_logp, tis_clip)
    loss = (token_loss * tis * weights).sum()
    mask = (weights != 0).float()
    sums = {
        "clipped_tokens": (clipped * mask).sum().detach(),
        "logprob_abs_diff": ((old_logp.detach() - rollout_logp).abs() * mask).sum(),
        "tokens": mask.sum(),
    }
    return loss, sums
