"""GRPO math against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from relax_slurm.algos import (
    compute_advantages, names, policy_loss, ppo_clip, reduction_weights, truncated_is_weights,
)


def group_advantages(rewards, std_normalize):
    return compute_advantages("grpo", rewards, std_normalize=std_normalize)


def ppo_clip_token_loss(logp, old, adv, eps_clip, eps_clip_high):
    return ppo_clip(logp - old, adv, eps_clip, eps_clip_high)


def test_grpo_is_registered():
    assert "grpo" in names()


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(r, std_normalize=True)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    assert torch.allclose(adv[0], expected)
    assert torch.equal(adv[1], torch.zeros(4))  # identical rewards carry no signal


def test_group_advantages_mean_only():
    r = torch.tensor([[3.0, 1.0]])
    assert torch.equal(group_advantages(r, std_normalize=False), torch.tensor([[1.0, -1.0]]))


def test_ppo_clip_by_hand():
    # ratios 1.5 (A>0, clipped at 1.2), 0.5 (A<0, clipped at 0.8), 1.1 (A>0, inside the band)
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    adv = torch.tensor([2.0, -1.0, 1.0])
    loss, clipped = ppo_clip_token_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.2)
    assert torch.allclose(loss, torch.tensor([-1.2 * 2.0, 0.8, -1.1]))
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_ppo_clip_higher():
    logp = torch.log(torch.tensor([1.25]))
    loss, clipped = ppo_clip_token_loss(logp, torch.zeros(1), torch.tensor([1.0]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([-1.25]))  # 1.25 < 1.28: not clipped
    assert clipped.item() == 0.0


def test_reduction_weights_seq_mean_token_mean():
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])]
    w = reduction_weights(masks, "seq_mean_token_mean")
    assert torch.allclose(w[0], torch.tensor([0.25, 0.25, 0.0]))
    assert torch.allclose(w[1], torch.tensor([0.5, 0.0, 0.0]))
    tm = reduction_weights(masks, "token_mean")
    assert torch.allclose(torch.cat(tm), torch.tensor([1 / 3, 1 / 3, 0, 1 / 3, 0, 0]))
    with pytest.raises(ValueError):
        reduction_weights(masks, "nope")


@pytest.mark.parametrize("reduction", ["seq_mean_token_mean", "token_mean", "token_sum"])
def test_batched_reduction_weights_are_the_per_sample_formula_bit_for_bit(reduction):
    """One flat computation for the batch gives each sample exactly what its own formula did
    (empty and all-zero masks included, a streaming part of a larger batch too)."""
    rng = np.random.default_rng(0)
    masks = [torch.from_numpy((rng.random(int(k)) > 0.3).astype(np.float32))
             for k in rng.integers(0, 30, 200)] + [torch.zeros(4), torch.zeros(0)]
    n = len(masks) if reduction == "token_mean" else 500
    total = sum(float(m.sum()) for m in masks)
    expected = {"seq_mean_token_mean": lambda m: m / (m.sum().clamp(min=1.0) * n),
                "token_mean": lambda m: m / max(total, 1.0),
                "token_sum": lambda m: m / n}[reduction]
    got = reduction_weights(masks, reduction, batch_samples=n)
    assert len(got) == len(masks)
    for m, w in zip(masks, got):
        assert w.dtype == torch.float32 and torch.equal(w, expected(m))
    assert reduction_weights([], reduction) == []


def test_tis_weights_are_capped_and_detached():
    train = torch.tensor([0.0, 2.0], requires_grad=True)
    w = truncated_is_weights(train, torch.tensor([0.0, 0.0]), clip=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0]))
    assert not w.requires_grad
    assert torch.equal(truncated_is_weights(train, torch.zeros(2), None), torch.ones(2))


def test_grpo_policy_loss_by_hand_and_gradient():
    # two samples of two tokens; second token of sample 1 is padding (weight 0)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0], [-0.5 - math.log(3.0), 0.0]])  # tis = 3 -> capped 2
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    weights = reduction_weights([torch.ones(2), torch.tensor([1.0, 0.0])], "seq_mean_token_mean")
    weights = torch.stack(weights)
    loss, sums = policy_loss("grpo", logp, logp.detach(), adv, weights, rollout,
                             reduction="weighted_sum", eps_clip=0.2, tis_clip=2.0)
    # ratio = 1 everywhere: per-token loss = -A; sample 1 mean -1, sample 2: +1 * tis 2
    assert loss.item() == pytest.approx(0.5 * (-1.0) + 0.5 * (1.0 * 2.0))
    loss.backward()
    # d/dlogp of -ratio*A*tis*w at ratio=1 is -A*tis*w
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))
    assert sums["tokens"].item() == 3
    assert sums["logprob_abs_diff"].item() == pytest.approx(math.log(3.0))


def test_policy_loss_reduces_with_a_plain_mask():
    # ratio 1, A = [[1, 1], [-1, pad]]: seq_mean_token_mean = mean(-1, +1) = 0; token_mean = -1/3
    logp = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = policy_loss("grpo", logp, logp, adv, mask)
    assert loss.item() == pytest.approx(0.0)
    loss, _ = policy_loss("grpo", logp, logp, adv, mask, reduction="token_mean")
    assert loss.item() == pytest.approx(-1.0 / 3.0)
