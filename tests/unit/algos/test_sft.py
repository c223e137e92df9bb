"""algo=sft: the token NLL registered as an algorithm, against hand-computed values."""

from __future__ import annotations

import doctest

import pytest
import torch

from relax_slurm.algos import compute_advantages, policy_loss, reduction_weights, sft
from relax_slurm.trainer.batch import loss_params
from relax_slurm.config.algo import AlgoConfig

LOGP = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -3.0, -0.7]])
MASK = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
# trained tokens' NLL: 2.0, 1.0 (row 0) and 0.1 (row 1)


def test_doctests():
    assert doctest.testmod(sft).failed == 0


@pytest.mark.parametrize("reduction,expected", [
    ("token_mean", (2.0 + 1.0 + 0.1) / 3),           # what conf/algo/sft.yaml uses
    ("seq_mean_token_mean", ((2.0 + 1.0) / 2 + 0.1) / 2),
    ("token_sum", (2.0 + 1.0 + 0.1) / 2),            # per sample
])
def test_loss_is_the_masked_nll_under_each_reduction(reduction, expected):
    logp = LOGP.clone().requires_grad_(True)
    weights = torch.stack(reduction_weights(list(MASK), reduction))
    adv = compute_advantages("sft", torch.zeros(1, 2)).reshape(2, 1).expand(2, 3)
    loss, metrics = policy_loss("sft", logp, logp.detach(), adv, weights, None,
                                reduction="weighted_sum", tis_clip=None)
    assert loss.item() == pytest.approx(expected)
    assert metrics["tokens"].item() == 3 and metrics["clipped_tokens"].item() == 0
    loss.backward()
    # d loss / d logp = -weight: prompt (masked) tokens get no gradient at all
    assert torch.equal(logp.grad, -weights)
    assert torch.all(logp.grad[MASK == 0] == 0)


def test_advantages_are_one_whatever_the_rewards():
    assert torch.equal(compute_advantages("sft", torch.tensor([[3.0, -1.0]])), torch.ones(1, 2))


def test_the_trainer_call_with_the_yaml_knobs_ignores_the_zero_rollout_logprobs():
    """The trainer passes every knob and the rows' (zero) rollout log-probs; with the preset's
    tis_clip=null they change nothing but the logprob_abs_diff sum (not logged by SFT)."""
    cfg = AlgoConfig(name="sft", tis_clip=None, loss_reduction="token_mean")
    weights = torch.stack(reduction_weights(list(MASK), cfg.loss_reduction))
    loss, metrics = policy_loss("sft", LOGP, LOGP, torch.ones(2, 3), weights, torch.zeros(2, 3),
                                reduction="weighted_sum", **loss_params(cfg))
    assert loss.item() == pytest.approx(3.1 / 3)
    assert metrics["logprob_abs_diff"].item() == pytest.approx(3.1)
