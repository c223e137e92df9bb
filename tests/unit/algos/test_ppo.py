"""PPO's critic math (relax_slurm/algos/ppo.py) against values worked out by hand."""

import math

import pytest
import torch

from relax_slurm.algos.ppo import gae, last_token_rewards, value_loss, whiten


def test_the_score_goes_on_each_rows_last_trained_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    r = last_token_rewards(torch.tensor([[2.0], [-1.0], [5.0]]).expand(3, 4), mask)
    # row 2 trains no token: its score goes nowhere
    assert r.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]


def test_gae_by_hand():
    # one row, 3 trained tokens, reward 1 at the end; V = [0.5, 0.2, 0.4]; gamma 0.9, lam 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.5)
    # delta_2 = 1 - 0.4 = 0.6;  A_2 = 0.6
    # delta_1 = 0 + 0.9 * 0.4 - 0.2 = 0.16;  A_1 = 0.16 + 0.45 * 0.6 = 0.43
    # delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32; A_0 = -0.32 + 0.45 * 0.43 = -0.1265
    assert adv[0].tolist() == pytest.approx([-0.1265, 0.43, 0.6])
    assert ret[0].tolist() == pytest.approx([-0.1265 + 0.5, 0.43 + 0.2, 0.6 + 0.4])


def test_gae_with_gamma_and_lambda_one_is_the_score_minus_the_value():
    values = torch.tensor([[0.3, -0.2, 0.7, 0.1]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # position 0 is the prompt's
    adv, ret = gae(last_token_rewards(torch.ones(1, 4), mask), values, mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 1.2, 0.3, 0.9])
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])  # every return is the score


def test_gae_skips_untrained_positions_inside_a_row():
    # trained tokens at 0 and 2 (an environment token at 1): the recursion goes 2 -> 0
    values = torch.tensor([[0.5, 9.0, 0.4]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = gae(torch.tensor([[0.0, 7.0, 1.0]]), values, mask, gamma=0.9, lam=0.5)
    # A_2 = 1 - 0.4 = 0.6; delta_0 = 0.9 * 0.4 - 0.5 = -0.14; A_0 = -0.14 + 0.45 * 0.6 = 0.13
    assert adv[0].tolist() == pytest.approx([0.13, 0.0, 0.6])
    assert ret[0].tolist() == pytest.approx([0.63, 0.0, 1.0])


def test_whiten_by_hand_and_across_ranks():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # trained values 1, 2, 3, 6: mean 3, unbiased var (4 + 1 + 0 + 9) / 3 = 14 / 3
    out = whiten(x, mask)
    sd = math.sqrt(14 / 3 + 1e-8)
    assert out.flatten().tolist() == pytest.approx([-2 / sd, -1 / sd, 0.0, 0.0, 3 / sd, 0.0])
    # the same batch split over two "ranks": each adds the other's moments
    halves = [(x[:1], mask[:1]), (x[1:], mask[1:])]
    moments = [torch.stack([(h * (m != 0)).double().sum(), (h * h * (m != 0)).double().sum(),
                            (m != 0).double().sum()]) for h, m in halves]
    total = moments[0] + moments[1]
    split = [whiten(h, m, reduce=lambda _t: total.clone()) for h, m in halves]
    assert torch.cat(split).flatten().tolist() == pytest.approx(out.flatten().tolist())


def test_value_loss_by_hand():
    old = torch.tensor([[1.0, 1.0, 1.0]])
    values = torch.tensor([[1.5, 0.9, 0.5]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    loss, clipped = value_loss(values, old, returns, value_clip=0.2)
    # token 0: V 1.5 -> clipped 1.2; (1.5 - 2)^2 = 0.25 < (1.2 - 2)^2 = 0.64: clipped term wins
    # token 1: V 0.9 inside the band: both 0.81
    # token 2: V 0.5 -> clipped 0.8; (0.5)^2 = 0.25 < 0.64: clipped wins (gradient-free)
    assert loss[0].tolist() == pytest.approx([0.32, 0.405, 0.32])
    assert clipped.tolist() == [[1.0, 0.0, 1.0]]
    loss.sum().backward()
    # only the unclipped token moves V: d/dV 0.5 (V - R)^2 = V - R = 0.9
    assert values.grad.tolist() == [pytest.approx([0.0, 0.9, 0.0])]
    plain, none = value_loss(values, old, returns, value_clip=None)
    assert plain[0].tolist() == pytest.approx([0.125, 0.405, 0.125])
    assert none.sum().item() == 0


def test_token_rewards_carry_the_reward_side_kl():
    from relax_slurm.algos.ppo import token_rewards

    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    scores = torch.ones(1, 4)
    kl = torch.tensor([[5.0, 0.5, -1.0, 0.25]])  # position 0 (prompt) adds nothing
    r = token_rewards(scores, mask, kl, kl_coef=0.1)
    assert r[0].tolist() == pytest.approx([0.0, -0.05, 0.1, 1.0 - 0.025])
    # gamma = lam = 1, V = 0: each token's advantage is the score minus kl_coef x its KL to go
    adv, _ = gae(r, torch.zeros(1, 4), mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 1 - 0.1 * (0.5 - 1.0 + 0.25),
                                             1 - 0.1 * (-1.0 + 0.25), 1 - 0.1 * 0.25])
    assert torch.equal(token_rewards(scores, mask, kl, kl_coef=0.0), token_rewards(scores, mask))


def test_policy_loss_does_not_fold_the_kl_twice_for_ppo():
    from relax_slurm.algos import policy_loss

    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([[1.0, 1.0]])
    ppo, m = policy_loss("ppo", logp, logp, adv, torch.ones(1, 2), ref_logprobs=ref,
                         kl_coef=0.1, kl_loss_type="k1")
    plain, _ = policy_loss("ppo", logp, logp, adv, torch.ones(1, 2))
    assert ppo.item() == plain.item()  # the KL is in ppo's token rewards already
    assert m["reward_kl"].item() == pytest.approx(0.5 - 1.0)  # still logged
    grpo, _ = policy_loss("grpo", logp, logp, adv, torch.ones(1, 2), ref_logprobs=ref,
                          kl_coef=0.1, kl_loss_type="k1")
    assert grpo.item() != plain.item()
