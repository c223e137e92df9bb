"""Algorithms by name: each is an advantage estimator plus a per-token policy loss.

Adding an algorithm is one file that calls `register(...)` and one YAML under `conf/algo/`.
The trainer only ever calls `compute_advantages` and `policy_loss` with `algo.name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from relax_slurm.algos import reduce as reductions
from relax_slurm.algos.common import truncated_is_weights

# (rewards [B, G], **params) -> advantages [B, G]
AdvantageFn = Callable[..., Tensor]
# (logp, old_logp, advantages, loss_mask, **params) -> (token loss [N, T], clipped 0/1 [N, T])
TokenLossFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: AdvantageFn
    token_loss: TokenLossFn


_ALGOS: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    if algo.name in _ALGOS:
        raise ValueError(f"algorithm {algo.name!r} registered twice")
    _ALGOS[algo.name] = algo
    return algo


def names() -> list[str]:
    return sorted(_ALGOS)


def get(name: str) -> Algorithm:
    try:
        return _ALGOS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; choose one of {names()}") from None


def compute_advantages(name: str, rewards: Tensor, **params) -> Tensor:
    """Advantages [B, G] for B prompts x G samples each, by the named algorithm's estimator."""
    return get(name).advantages(rewards, **params)


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    rollout_logprobs: Tensor | None = None,
    *,
    reduction: str = "seq_mean_token_mean",
    tis_clip: float | None = None,
    **params,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The named algorithm's loss over token tensors shaped [N, T]; returns (loss, metrics).

    `advantages` are per token (a sample's advantage broadcast over its tokens). With
    `rollout_logprobs`, token losses are weighted by truncated importance sampling
    min(exp(old - rollout), tis_clip). `reduction="weighted_sum"` takes `loss_mask` as
    precomputed per-token weights (see `reduce.reduction_weights`), which is how the trainer
    makes the loss independent of how a batch is split over ranks and micro-batches.
    Metrics are mask-weighted sums (`clipped_tokens`, `logprob_abs_diff`, `tokens`) so callers
    can add them across micro-batches and ranks before dividing.
    """
    token_loss, clipped = get(name).token_loss(logprobs, old_logprobs, advantages, loss_mask,
                                               **params)
    mask = (loss_mask != 0).float()
    metrics = {"clipped_tokens": (clipped * mask).sum().detach(), "tokens": mask.sum()}
    if rollout_logprobs is not None:
        token_loss = token_loss * truncated_is_weights(old_logprobs, rollout_logprobs, tis_clip)
        metrics["logprob_abs_diff"] = ((old_logprobs.detach() - rollout_logprobs).abs() * mask).sum()
    return reductions.reduce(token_loss, loss_mask, reduction), metrics
