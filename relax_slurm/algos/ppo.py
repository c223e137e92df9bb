"""PPO with a critic: GAE advantages from a learned value per token, the clipped value loss.

Token tensors are [N, T] (N samples, T positions); `mask != 0` marks the trained (response)
tokens, and only those take part in the recursions: an untrained position (prompt, environment
tokens, padding) is skipped, so the next trained token's value and advantage carry across it.

- `gae`: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next,
  R_t = A_t + V_t.
  The reward is the sample's score on its last trained token, minus kl_coef x each token's KL
  to the reference with the reward-side KL (`token_rewards`).
- `whiten`: (A - mean) / sqrt(var + 1e-8) over every trained token of the batch (unbiased var,
  as verl's masked_whiten); `reduce` adds the moments across ranks.
- `value_loss`: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) per token.

The policy side is the PPO clip on these advantages; the estimator registered as `ppo` only
passes the sample's score through (the trainer's critic turns it into per-token advantages,
relax_slurm/trainer/critic.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from relax_slurm.algos.grpo import ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import NoParams

WHITEN_EPS = 1e-8


def score_passthrough(rewards: Tensor, p: NoParams) -> Tensor:
    """The sample's score, [B, G]: PPO's advantages come from the critic (GAE), per token."""
    return rewards.clone()


def last_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Token rewards [N, T]: each row's score on its last trained token, 0 elsewhere. `scores`
    [N, T] holds the row's score at its trained tokens (a sample's score broadcast over them,
    as the trainer's advantages arrive); a row with no trained token gets none."""
    trained = mask != 0
    pos = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(trained, pos, torch.full_like(pos, -1)).max(dim=1, keepdim=True).values
    return torch.where(trained & (pos == last), scores, torch.zeros_like(scores))


def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
                  ) -> Tensor:
    """PPO's token rewards [N, T]: the score on each row's last trained token
    (`last_token_rewards`), minus `kl_coef` x the per-token KL to the reference (`kl` [N, T],
    algo.kl_coef, the reward-side KL) on every trained token."""
    rewards = last_token_rewards(scores, mask)
    if kl is None or not kl_coef:
        return rewards
    return rewards - kl_coef * torch.where(mask != 0, kl.detach(), torch.zeros_like(kl))


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each row's trained tokens: (advantages, returns),
    both [N, T] and 0 off the mask. After a row's last trained token the value is 0 (the
    response ended). No gradient."""
    rewards, values = rewards.detach(), values.detach()
    trained = mask != 0
    n, t_len = values.shape
    next_v = values.new_zeros(n)
    next_a = values.new_zeros(n)
    adv = torch.zeros_like(values)
    for t in reversed(range(t_len)):
        on = trained[:, t]
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
        next_v = torch.where(on, values[:, t], next_v)
        next_a = torch.where(on, a, next_a)
    returns = torch.where(trained, adv + values, torch.zeros_like(adv))
    return adv, returns


def whiten(x: Tensor, mask: Tensor, reduce: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """x [N, T] whitened over its trained tokens: (x - mean) / sqrt(var + 1e-8), unbiased var;
    0 off the mask. `reduce` sums a float64 tensor of (sum, sum of squares, count) over every
    rank holding part of the batch (an all-reduce), so the statistics are the whole batch's."""
    m = (mask != 0)
    xs = torch.where(m, x.detach(), torch.zeros_like(x)).double()
    moments = reduce(torch.stack([xs.sum(), (xs * xs).sum(), m.sum().double()]))
    total, sq, count = moments.tolist()
    mean = total / max(count, 1.0)
    var = (sq / max(count, 1.0) - mean * mean) * (count / (count - 1) if count > 1 else 0.0)
    out = (x.detach() - mean) * (max(var, 0.0) + WHITEN_EPS) ** -0.5
    return torch.where(m, out, torch.zeros_like(out))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
               value_clip: float | None) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss and a 0/1 map of where the clipped term is the larger one:
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); `value_clip=None`: the plain
    0.5 * (V - R)^2 (nothing clipped)."""
    plain = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped_v = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), (clipped > plain).to(values.dtype)


register(Algorithm(name="ppo", advantages=score_passthrough, token_loss=ppo_clip_token_loss,
                   kl_in_rewards=True))
