"""Reward-side KL (algo.kl_coef): A_t <- A_t - kl_coef * sum_{s >= t} kl_s, checked against values
worked out by hand, and its validation against the estimators."""

import pytest
import torch

from relax_slurm.algos import policy_loss
from relax_slurm.algos.common import kl_to_go
from relax_slurm.config.algo import NO_REWARD_KL_ALGOS, AlgoConfig
from relax_slurm.errors import ConfigError

# one response of 3 tokens: k1 = old - ref = [0.5, -1.0, 0.0]
OLD = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])


def test_kl_to_go_sums_from_each_token_to_the_end():
    # to go: [0.5 - 1.0 + 0.0, -1.0 + 0.0, 0.0]
    assert kl_to_go(OLD, REF, torch.ones(1, 3), "k1").tolist() == [[-0.5, -1.0, 0.0]]
    # an environment token (mask 0) in the middle adds nothing: [0.5 + 0 + 0, 0, 0]
    assert kl_to_go(OLD, REF, torch.tensor([[1.0, 0.0, 1.0]]), "k1").tolist() == [
        [0.5, 0.0, 0.0]]
    # k2 = r^2 / 2 with r = ref - old = [-0.5, 1, 0]: [0.125, 0.5, 0] -> to go [0.625, 0.5, 0]
    assert kl_to_go(OLD, REF, torch.ones(1, 3), "k2").tolist() == [[0.625, 0.5, 0.0]]


def test_reward_kl_lowers_each_tokens_advantage_by_the_kl_to_go():
    logp = OLD.clone().requires_grad_(True)  # ratio 1: the loss is -mean_t(A'_t)
    adv = torch.ones(1, 3)
    loss, m = policy_loss("grpo", logp, OLD, adv, torch.ones(1, 3), ref_logprobs=REF,
                          kl_coef=0.1, kl_loss_type="k1")
    # A' = 1 - 0.1 * [-0.5, -1.0, 0.0] = [1.05, 1.1, 1.0]; loss = -(1.05 + 1.1 + 1.0) / 3
    assert loss.item() == pytest.approx(-3.15 / 3, rel=1e-6)
    loss.backward()
    # d loss / d logp_t = -A'_t * ratio / 3 (the KL term itself carries no gradient)
    assert logp.grad[0].tolist() == pytest.approx([-1.05 / 3, -1.1 / 3, -1.0 / 3], rel=1e-6)
    assert m["reward_kl"].item() == pytest.approx(-0.5)  # the sum of k1 over trained tokens
    with pytest.raises(ValueError, match="kl_coef=0.1 needs the reference"):
        policy_loss("grpo", logp, OLD, adv, torch.ones(1, 3), kl_coef=0.1)


def test_reward_kl_applies_to_any_estimators_advantages_and_is_off_at_zero():
    logp = OLD.clone().requires_grad_(True)
    adv = torch.full((1, 3), -2.0)
    base, m0 = policy_loss("gspo", logp, OLD, adv, torch.ones(1, 3), ref_logprobs=REF,
                           eps_clip=3e-4, eps_clip_high=4e-4)
    assert "reward_kl" not in m0 and base.item() == pytest.approx(2.0)
    folded, _ = policy_loss("gspo", logp, OLD, adv, torch.ones(1, 3), ref_logprobs=REF,
                            kl_coef=1.0, kl_loss_type="k1", eps_clip=3e-4, eps_clip_high=4e-4)
    # A' = -2 - [-0.5, -1, 0] = [-1.5, -1, -2]: mean 1.5 with the sequence ratio 1
    assert folded.item() == pytest.approx(1.5)


def test_estimators_with_no_place_for_it_are_refused_with_the_reason():
    assert NO_REWARD_KL_ALGOS == {"rloo", "reinforce_plus_plus_baseline"}  # Relax's spec
    for name in sorted(NO_REWARD_KL_ALGOS):
        with pytest.raises(ConfigError, match=rf"algo={name} has no place.*kl_loss_coef"):
            AlgoConfig(name=name, kl_coef=0.01)
    assert AlgoConfig(name="grpo", kl_coef=0.01).uses_reference
    with pytest.raises(ConfigError, match="algo.kl_coef=-1"):
        AlgoConfig(kl_coef=-1.0)
