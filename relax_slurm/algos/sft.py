"""Supervised fine-tuning as an algorithm: the negative log-likelihood of the target tokens.

    loss = sum_t w_t * (-log p(y_t | y_<t, x)),   w = loss_mask / (trained tokens in the batch)

The trainer folds the reduction into the weights over the whole batch (`algo.loss_reduction`,
token_mean in conf/algo/sft.yaml), so the batch's loss is the token-mean NLL of its response
(assistant) tokens whatever the split over ranks and micro-batches. There is no reward, so the
"advantage" is 1 for every row and the token loss ignores it; nothing is clipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import NoParams


def sft_advantages(rewards: Tensor, p: NoParams) -> Tensor:
    """Every row counts fully: 1 for each of [B, G] (SFT has no reward to centre)."""
    return torch.ones_like(rewards)


def nll_token_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                   p: NoParams = NoParams()) -> tuple[Tensor, Tensor]:
    """Per-token NLL, [N, T], and the 0/1 clip map (all 0: nothing is clipped).

    >>> loss, clipped = nll_token_loss(torch.tensor([[-0.5, -2.0]]), None, None, None)
    >>> loss.tolist(), clipped.tolist()
    ([[0.5, 2.0]], [[0.0, 0.0]])
    """
    return -logprobs, torch.zeros_like(logprobs)


SFT = register(Algorithm("sft", sft_advantages, nll_token_loss))
