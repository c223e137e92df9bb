"""GSPO, SAPO, OPD, RLOO, REINFORCE++, DAPO against values computed by hand."""

import math

import pytest
import torch

from relax_slurm.algos import (
    compute_advantages, is_informative_group, names, overlong_penalty, policy_loss, ppo_clip,
)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- advantages ----------------------------------------------------------------------------

def test_rloo_leave_one_out_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    adv = compute_advantages("rloo", r, std_normalize=True, eps_clip=0.2)  # extra params ignored
    # r=1: 1 - (0 + 0 + 1)/3 = 2/3; r=0: 0 - (1 + 0 + 1)/3 = -2/3
    assert torch.allclose(adv[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.equal(adv[1], torch.zeros(4))
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_advantages("rloo", torch.tensor([[1.0]]))


def test_reinforce_plus_plus_whitens_over_the_batch():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # batch mean 0.75; unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.25 -> std 0.5
    adv = compute_advantages("reinforce_plus_plus", r)
    assert torch.allclose(adv, torch.tensor([[0.25, -0.75], [0.25, 0.25]]) / (0.5 + 1e-6))
    # one sample: no spread, advantage 0 instead of nan
    assert torch.equal(compute_advantages("reinforce_plus_plus", torch.tensor([[2.0]])),
                       torch.zeros(1, 1))


def test_reinforce_plus_plus_baseline_by_hand():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # group-centred: [[0.5, -0.5], [0, 0]]; unbiased std of [0.5, -0.5, 0, 0] = sqrt(0.5 / 3)
    std = math.sqrt(0.5 / 3)
    adv = compute_advantages("reinforce_plus_plus_baseline", r)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / (std + 1e-6))


@pytest.mark.parametrize("name", ["dapo", "gspo", "sapo", "opd"])
def test_group_normalised_families_use_grpo_advantages(name):
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6)
    assert torch.allclose(compute_advantages(name, r, std_normalize=True), expected)
    assert torch.equal(compute_advantages(name, r, std_normalize=False),
                       torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


# ---- PPO clip boundaries --------------------------------------------------------------------

@pytest.mark.parametrize("ratio,adv,loss,clipped", [
    (1.19, 1.0, -1.19, 0.0),   # inside the band
    (1.21, 1.0, -1.2, 1.0),    # above 1 + eps with A > 0: clipped
    (1.5, -1.0, 1.5, 0.0),     # above the band with A < 0: the unclipped (larger) loss wins
    (0.79, -1.0, 0.8, 1.0),    # below 1 - eps with A < 0: clipped
    (0.5, 1.0, -0.5, 0.0),     # below the band with A > 0: unclipped
])
def test_ppo_clip_boundaries(ratio, adv, loss, clipped):
    out, flag = ppo_clip(torch.log(torch.tensor([ratio])), torch.tensor([adv]), 0.2, 0.2)
    assert out.item() == pytest.approx(loss, rel=1e-6)
    assert flag.item() == clipped


# ---- GSPO -----------------------------------------------------------------------------------

def test_gspo_uses_the_sequence_mean_log_ratio():
    # one sample, tokens 0-1 trained, token 2 padding with a junk log-ratio
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(1.5), 0.0, 5.0]], requires_grad=True)
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    seq_ratio = math.sqrt(1.5)  # exp((ln 1.5 + 0) / 2) = 1.2247 > 1.2
    loss, m = policy_loss("gspo", logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert m["clipped_tokens"].item() == 2  # the whole sequence is clipped
    loss, m = policy_loss("gspo", logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-seq_ratio, rel=1e-6)
    assert m["clipped_tokens"].item() == 0
    loss.backward()
    # d(-ratio)/d logp_j = -ratio / 2 for each trained token, 0 for padding
    assert torch.allclose(logp.grad, torch.tensor([[-seq_ratio / 2, -seq_ratio / 2, 0.0]]))


# ---- SAPO -----------------------------------------------------------------------------------

def test_sapo_soft_gate_by_hand_and_tau_switch():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.3]]))
    adv = torch.tensor([[2.0, -1.0, 0.0]])
    loss, m = policy_loss("sapo", logp, torch.zeros(1, 3), adv, torch.ones(1, 3),
                          reduction="token_sum", tau_pos=1.0, tau_neg=1.05)
    f_pos = 4.0 * sigmoid(1.0 * 0.5)                 # tau_pos for A = 2 > 0
    f_neg = (4.0 / 1.05) * sigmoid(1.05 * (0.5 - 1))  # tau_neg for A = -1
    assert loss.item() == pytest.approx(-f_pos * 2.0 + f_neg * 1.0 + 0.0, rel=1e-5)
    assert m["clipped_tokens"].item() == 0
    # at ratio 1 the gate is 2 / tau: the sign of A picks tau
    at_one = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss("sapo", at_one, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]),
                          torch.ones(1, 2), reduction="token_sum", tau_pos=1.0, tau_neg=1.05)
    assert loss.item() == pytest.approx(-2.0 / 1.0 + 2.0 / 1.05, abs=1e-6)
    loss.backward()
    # slope of the gate at r = 1 is 1 whatever tau: the on-policy gradient is -A
    assert torch.allclose(at_one.grad, torch.tensor([[-1.0, 1.0]]))


# ---- OPD ------------------------------------------------------------------------------------

def test_opd_subtracts_the_teacher_gap_per_token():
    old = torch.tensor([[-1.0, -2.0, -0.1]])
    teacher = torch.tensor([[-1.5, -1.0, -9.0]])  # token 2 is padding
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # student - teacher = [0.5, -1.0]; coef 0.5 -> A' = [1 - 0.25, 1 + 0.5]; ratio 1 -> -A'
    loss, m = policy_loss("opd", old.clone(), old, adv, mask, teacher_logprobs=teacher,
                          opd_kl_coef=0.5)
    assert loss.item() == pytest.approx(-(0.75 + 1.5) / 2)
    assert m["opd_reverse_kl"].item() == pytest.approx(0.5 - 1.0)  # masked sum
    loss, _ = policy_loss("opd", old.clone(), old, adv, mask, teacher_logprobs=teacher,
                          opd_kl_coef=0.5, opd_only_reward=True)
    assert loss.item() == pytest.approx(-(-0.25 + 0.5) / 2)  # task advantage dropped
    with pytest.raises(ValueError, match="teacher_logprobs"):
        policy_loss("opd", old, old, adv, mask)


# ---- DAPO -----------------------------------------------------------------------------------

def test_dynamic_sampling_keeps_groups_with_spread():
    assert is_informative_group([1.0, 0.0, 0.0])
    assert is_informative_group(torch.tensor([0.3, 0.30001]))
    assert not is_informative_group([1.0, 1.0, 1.0])
    assert not is_informative_group(torch.zeros(4))
    assert not is_informative_group([1.0])  # one sample has no spread


@pytest.mark.parametrize("length,want", [
    (0, 0.0), (80, 0.0),         # up to max_len - buffer: no penalty
    (81, -0.05 * 1.5), (90, -0.5 * 1.5), (100, -1.5),  # linear over the buffer
    (130, -1.5),                 # beyond max_len: capped at the factor
])
def test_overlong_penalty_by_hand(length, want):
    assert overlong_penalty(length, max_len=100, buffer_len=20, penalty_factor=1.5) == \
        pytest.approx(want)


def test_overlong_penalty_disabled_without_buffer():
    assert overlong_penalty(10_000, max_len=100, buffer_len=0, penalty_factor=1.0) == 0.0


def test_dapo_clip_higher_from_its_defaults():
    # ratio 1.25 with A > 0: inside DAPO's [0.8, 1.28], outside GRPO's [0.8, 1.2]
    logp = torch.log(torch.tensor([[1.25]]))
    loss, m = policy_loss("dapo", logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                          eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["clipped_tokens"].item() == 0


def test_every_algorithm_is_listed():
    assert set(names()) >= {"grpo", "dapo", "gspo", "sapo", "opd", "rloo",
                            "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
