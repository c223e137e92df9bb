"""Pieces shared by several algorithms: the PPO clip, importance weights, KL estimators, OPSM.

Token tensors are [N, T] (N samples, T positions); masks are 0/1 or per-token weights, and only
`mask != 0` matters here.
"""

from __future__ import annotations

import torch
from torch import Tensor

TIS_TYPES = ("truncate", "icepop")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def truncated_is_weights(train_logp: Tensor, rollout_logp: Tensor, clip: float | None) -> Tensor:
    """Per-token importance weights exp(train - rollout) capped at `clip` (no gradient).

    Corrects for the engine and the trainer computing slightly different distributions (and, in
    async mode, for older engine weights) without letting a rare token dominate the gradient.
    """
    if clip is None:
        return torch.ones_like(train_logp)
    return torch.exp(train_logp.detach() - rollout_logp).clamp(max=clip)


def importance_weights(
    train_logp: Tensor, rollout_logp: Tensor, clip: float | None, kind: str = "truncate",
    clip_low: float | None = None,
) -> Tensor:
    """Per-token weights w = exp(train - rollout) (no gradient), truncated or icepop-masked.

    - truncate: min(w, clip) (see `truncated_is_weights`);
    - icepop: w inside [clip_low, clip], 0 outside: tokens on which engine and trainer disagree
      too much are dropped instead of down-weighted (clip_low defaults to 1 / clip).
    `clip=None` disables both (all ones).
    """
    if kind not in TIS_TYPES:
        raise ValueError(f"unknown tis_type {kind!r}; choose one of {TIS_TYPES}")
    if kind == "truncate" or clip is None:
        return truncated_is_weights(train_logp, rollout_logp, clip)
    low = 1.0 / clip if clip_low is None else clip_low
    w = torch.exp(train_logp.detach() - rollout_logp)
    return torch.where((w >= low) & (w <= clip), w, torch.zeros_like(w))


def ppo_clip(
    log_ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss and a 0/1 map of where a clip bound wins.

    loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
    Dual-clip (`eps_clip_c` = c > 1, Ye et al. 2020): for A < 0 the loss is also capped at
    -c * A, so a token whose ratio ran far above 1 under a negative advantage cannot blow up
    the update: loss = min(that, -c * A) where A < 0.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    flag = clipped > unclipped
    if eps_clip_c is not None:
        cap = -eps_clip_c * advantages
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        flag = flag | capped
    return loss, flag.float()


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens, differentiable in logp.

    With r = ref_logp - logp: k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1 (unbiased and >= 0),
    low_var_kl = k3 with r clamped to +-20 and the result to +-10, so that one token whose
    probability collapsed under the policy cannot dominate the loss.
    """
    if kind not in KL_TYPES:
        raise ValueError(f"unknown kl_loss_type {kind!r}; choose one of {KL_TYPES}")
    r = ref_logp - logp
    if kind == "k1":
        return -r
    if kind == "k2":
        return 0.5 * r * r
    if kind == "low_var_kl":
        r = r.clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)
    return torch.exp(r) - r - 1.0


def kl_to_go(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str) -> Tensor:
    """Per-token sum of the KL penalty from each trained token to the end of its row, [N, T]:
    c_t = sum_{s >= t, mask_s != 0} kl_s with kl = kl_penalty(logp, ref_logp, kind), no
    gradient. The reward-side KL (algo.kl_coef) as a return: every token of a response is
    charged the KL of itself and what follows it (REINFORCE++'s token rewards -kl_coef * kl_t
    summed into returns with gamma 1). Untrained positions (prompt, environment tokens) add
    nothing.
    """
    kl = kl_penalty(logp.detach(), ref_logp, kind) * (mask != 0).to(logp.dtype)
    return torch.flip(torch.cumsum(torch.flip(kl, [-1]), -1), [-1])


def distilled_advantages(
    advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, opd_kl_coef: float,
    opd_only_reward: bool = False,
) -> Tensor:
    """Token advantages [N, T] with the teacher term (no gradient); only_reward drops the task A."""
    base = torch.zeros_like(advantages) if opd_only_reward else advantages
    return base - opd_kl_coef * (student_logp.detach() - teacher_logp)


def masked_row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of each row of `x` over its masked tokens, [N, 1]; 0 for a row with no token."""
    m = (mask != 0).to(x.dtype)
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


def opsm_keep(
    logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> Tensor:
    """Off-policy sequence masking: 0 for sequences with A < 0 and KL(behaviour || policy) > delta.

    KL per sequence is the token mean of behaviour_logp - logp (no gradient). A negative
    advantage on a sample the current policy already finds unlikely pushes probability mass into
    noise; dropping such sequences stabilises training on stale or mismatched rollouts. [N, 1].
    """
    kl = masked_row_mean(behaviour_logp - logp.detach(), mask)
    adv = masked_row_mean(advantages, mask)
    return 1.0 - ((adv < 0) & (kl > delta)).to(logp.dtype)
