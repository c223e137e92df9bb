"""Loss reductions: from per-token losses [N, T] to one scalar."""

from __future__ import annotations

import torch
from torch import Tensor

REDUCTIONS = ("seq_mean_token_mean", "token_mean", "token_sum")


def reduction_weights(masks: list[Tensor], reduction: str, batch_samples: int | None = None
                      ) -> list[Tensor]:
    """Per-token weights over a whole batch so that sum(w * token_loss) is the batch loss.

    Computed once over the full batch (before it is split across ranks) so that the loss is the
    same however samples are sharded or micro-batched.
    - seq_mean_token_mean: mean over a sample's tokens, then mean over samples;
    - token_mean: mean over every token of the batch;
    - token_sum: plain sum over tokens, divided by the number of samples (a constant scale, as
      Dr.GRPO, so longer answers are not down-weighted).
    `batch_samples`: the batch's sample count when `masks` are only some of its samples (a
    streaming trainer weighs groups as they arrive); token_mean needs every mask.
    """
    n = len(masks) if batch_samples is None else batch_samples
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {REDUCTIONS}")
    if reduction == "token_mean" and batch_samples is not None and batch_samples != len(masks):
        raise ValueError("loss_reduction=token_mean divides by the whole batch's token "
                         "count: pass every sample's mask")
    if not masks:
        return []
    # one flat tensor and a handful of ops for the whole batch, not a few per sample (a batch
    # of 512 short samples spent ~8 ms here); each weight is the same float32 division as a
    # per-sample m / (m.sum() * n) (a 0/1 mask's sums are exact in any order)
    lengths = [len(m) for m in masks]
    flat = torch.cat(masks)
    if reduction == "seq_mean_token_mean":
        row = torch.repeat_interleave(torch.arange(len(masks), device=flat.device),
                                      torch.tensor(lengths, device=flat.device))
        sums = torch.zeros(len(masks), dtype=flat.dtype, device=flat.device)
        sums.index_add_(0, row, flat)
        flat = flat / (sums.clamp(min=1.0) * n)[row]
    elif reduction == "token_mean":
        flat = flat / max(float(flat.sum()), 1.0)
    else:  # token_sum
        flat = flat / n
    return list(flat.split(lengths))


def reduce(token_loss: Tensor, loss_mask: Tensor, reduction: str) -> Tensor:
    """Reduce [N, T] token losses over the rows given; `weighted_sum` trusts the mask as weights."""
    if reduction == "weighted_sum":
        return (token_loss * loss_mask).sum()
    weights = reduction_weights(list(loss_mask.float()), reduction)
    return (token_loss * torch.stack(weights)).sum()
