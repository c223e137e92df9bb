"""Extra loss terms (entropy, KL to a reference, icepop, OPSM) and the config contract."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml

from relax_slurm.algos import (
    compute_advantages, importance_weights, kl_penalty, names, opsm_keep, policy_loss,
    reduction_weights,
)
from relax_slurm.config.algo import ALGO_NAMES, BATCH_WIDE_ADVANTAGE_ALGOS, AlgoConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.batch import loss_params

CONF_ALGO = Path(__file__).resolve().parents[3] / "conf" / "algo"


def zero_adv_inputs(n_tokens: int = 2):
    logp = torch.zeros(1, n_tokens, requires_grad=True)
    return logp, torch.zeros(1, n_tokens), torch.zeros(1, n_tokens), torch.ones(1, n_tokens)


# ---- entropy bonus --------------------------------------------------------------------------

def test_entropy_bonus_is_subtracted():
    logp, old, adv, mask = zero_adv_inputs()  # A = 0: the policy term is 0
    entropy = torch.tensor([[1.0, 2.0]])
    loss, m = policy_loss("grpo", logp, old, adv, mask, entropy=entropy, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-(0.1 + 0.2) / 2)
    assert m["entropy"].item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss("grpo", logp, old, adv, mask, entropy_coef=0.1)


# ---- KL to a reference model ----------------------------------------------------------------

@pytest.mark.parametrize("kind,want", [
    ("k1", 1.0),                         # logp - ref = -1 - (-2)
    ("k2", 0.5),                         # (ref - logp)^2 / 2
    ("k3", math.exp(-1.0) + 1.0 - 1.0),  # exp(r) - r - 1 with r = ref - logp = -1
    ("low_var_kl", math.exp(-1.0)),
])
def test_kl_estimators_by_hand(kind, want):
    assert kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), kind).item() == \
        pytest.approx(want, rel=1e-6)


def test_low_var_kl_is_clamped():
    logp, ref = torch.tensor([-30.0, -1.0]), torch.tensor([0.0, -1.0])
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == [10.0, 0.0]
    assert kl_penalty(logp, ref, "k3")[0].item() == pytest.approx(math.exp(30.0) - 31.0, rel=1e-5)
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "k4")


def test_kl_loss_term_and_gradient():
    logp, old, adv, mask = zero_adv_inputs()
    ref = torch.tensor([[-1.0, 0.0]])
    loss, m = policy_loss("grpo", logp, old, adv, mask, ref_logprobs=ref, kl_loss_coef=0.5,
                          kl_loss_type="k1")
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)  # k1 = logp - ref = [1, 0]
    assert m["kl_loss"].item() == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.25, 0.25]]))  # coef * d(k1)/dlogp / 2
    _, m = policy_loss("grpo", logp, old, adv, mask, ref_logprobs=ref, kl_loss_type="k1")
    assert m["kl_loss"].item() == pytest.approx(1.0)  # logged even when not in the loss
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss("grpo", logp, old, adv, mask, kl_loss_coef=0.5)


# ---- importance sampling: truncate and icepop -----------------------------------------------

def test_icepop_zeroes_weights_outside_the_band():
    old = torch.log(torch.tensor([1.0, 3.0, 0.1, 0.5]))
    rollout = torch.zeros(4)
    assert torch.allclose(importance_weights(old, rollout, 2.0, "truncate"),
                          torch.tensor([1.0, 2.0, 0.1, 0.5]))
    assert torch.allclose(importance_weights(old, rollout, 2.0, "icepop", 0.5),
                          torch.tensor([1.0, 0.0, 0.0, 0.5]))  # band edges are kept
    assert torch.allclose(importance_weights(old, rollout, 2.0, "icepop"),  # low = 1 / 2
                          torch.tensor([1.0, 0.0, 0.0, 0.5]))
    with pytest.raises(ValueError, match="tis_type"):
        importance_weights(old, rollout, 2.0, "nope")


def test_icepop_in_the_loss():
    logp = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[1.0, 0.2, 1.0]]))  # weights exp(0 - rollout): 1, 5, 1
    adv = torch.ones(1, 3)
    loss, m = policy_loss("grpo", logp, logp, adv, torch.ones(1, 3), rollout,
                          reduction="token_sum", tis_clip=2.0, tis_type="icepop")
    assert loss.item() == pytest.approx(-2.0)  # middle token dropped
    assert m["tis_masked_tokens"].item() == 1
    loss, _ = policy_loss("grpo", logp, logp, adv, torch.ones(1, 3), rollout,
                          reduction="token_sum", tis_clip=2.0)
    assert loss.item() == pytest.approx(-4.0)  # truncated: 1 + 2 + 1


# ---- OPSM -----------------------------------------------------------------------------------

def test_opsm_masks_negative_far_off_policy_sequences():
    logp = torch.zeros(3, 2)
    rollout = torch.tensor([[0.3, 0.1],    # KL 0.2 > 0.1 and A < 0: masked
                            [0.05, 0.05],  # KL 0.05, A < 0: kept
                            [0.9, 0.9]])   # KL 0.9 but A > 0: kept
    adv = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
    mask = torch.ones(3, 2)
    keep = opsm_keep(logp, rollout, adv, mask, delta=0.1)
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]
    loss, m = policy_loss("grpo", logp, logp, adv, mask, rollout, reduction="token_sum",
                          tis_clip=None, opsm_delta=0.1)
    assert loss.item() == pytest.approx(2.0 - 2.0)  # sample 0 dropped: +2 (sample 1) - 2
    assert m["opsm_masked_tokens"].item() == 2


# ---- the trainer's call, config and YAML ----------------------------------------------------

@pytest.mark.parametrize("name", ALGO_NAMES)
def test_trainer_style_call_with_every_config_field(name):
    cfg = AlgoConfig(name=name)
    params = dataclasses.asdict(cfg)
    params.pop("name")
    rewards = torch.tensor([[1.0, 0.0]])
    adv = compute_advantages(name, rewards, **params).flatten()
    params = loss_params(cfg)
    weights = torch.stack(reduction_weights([torch.ones(3), torch.tensor([1.0, 1.0, 0.0])],
                                            cfg.loss_reduction))
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    adv_tokens = adv[:, None].expand(2, 3)
    extra = {"teacher_logprobs": torch.full((2, 3), -1.2)} if name == "opd" else {}
    loss, m = policy_loss(name, logp, logp.detach(), adv_tokens, weights, torch.full((2, 3), -1.0),
                          reduction="weighted_sum", **params, **extra)
    loss.backward()
    assert torch.isfinite(loss) and m["tokens"].item() == 5
    assert torch.isfinite(logp.grad).all()


def test_static_names_match_the_registry():
    assert tuple(names()) == ALGO_NAMES


@pytest.mark.parametrize("name", ALGO_NAMES)
def test_batch_wide_estimators_are_the_ones_listed(name):
    """A streaming trainer computes advantages for the groups it has (trainer/stream.py): for
    every estimator not listed batch-wide, a group's advantages are bit for bit the same alone
    as in a batch; a listed one's change with the other groups' rewards."""
    params = dataclasses.asdict(AlgoConfig(name=name))
    params.pop("name")
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 1.0], [3.0, 2.0, 1.0, 0.5]])
    together = compute_advantages(name, rewards, **params)
    alone = torch.cat([compute_advantages(name, rewards[i:i + 1], **params) for i in range(3)])
    assert torch.equal(together, alone) == (name not in BATCH_WIDE_ADVANTAGE_ALGOS)


@pytest.mark.parametrize("name", ALGO_NAMES)
def test_each_algorithm_has_a_yaml(name):
    data = yaml.safe_load((CONF_ALGO / f"{name}.yaml").read_text())
    # an algorithm may also bring trainer settings it needs (conf/algo_trainer/NAME.yaml)
    assert data["name"] == name and data["defaults"][0] == "base_algo"
    assert data["defaults"][1:] in ([], [f"/algo_trainer/{name}"])
    cfg = AlgoConfig(**{k: v for k, v in data.items() if k != "defaults"})
    if name == "dapo":
        assert cfg.eps_clip_high == 0.28 and cfg.loss_reduction == "token_mean"
        assert cfg.dynamic_sampling


@pytest.mark.parametrize("overrides,key", [
    ({"name": "trpo"}, "algo.name"),
    ({"tis_type": "bogus"}, "algo.tis_type"),
    ({"tis_type": "icepop", "tis_clip": None}, "algo.tis_type"),
    ({"tis_type": "icepop", "tis_clip": 2.0, "tis_clip_low": 3.0}, "algo.tis_clip_low"),
    ({"kl_loss_type": "k4"}, "algo.kl_loss_type"),
    ({"entropy_coef": -1.0}, "algo.entropy_coef"),
    ({"tau_neg": 0.0}, "algo.tau_neg"),
    ({"opd_only_reward": True}, "algo.opd_only_reward"),
    ({"overlong_buffer_tokens": -1}, "algo.overlong_buffer_tokens"),
    ({"opsm_delta": -0.1}, "algo.opsm_delta"),
])
def test_bad_algo_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        AlgoConfig(**overrides)


# ---- dual-clip and CISPO (values by hand) ---------------------------------------------------

def test_dual_clip_caps_negative_advantages_only():
    from relax_slurm.algos import ppo_clip

    # ratios 5, 2, 5 with advantages -1, -1, +1; eps 0.2, c = 3
    log_ratio = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    plain, plain_flag = ppo_clip(log_ratio, adv, 0.2)
    assert plain.tolist()[0] == pytest.approx([5.0, 2.0, -1.2])  # max(-r A, -clip(r) A)
    loss, flag = ppo_clip(log_ratio, adv, 0.2, eps_clip_c=3.0)
    assert loss.tolist()[0] == pytest.approx([3.0, 2.0, -1.2])  # only 5 > 3 under A < 0 capped
    assert flag.tolist() == [[1.0, 0.0, 1.0]]
    loss.sum().backward()
    # the cap is a constant: no gradient there; -r A below it keeps d/dlog_ratio = -r A = 2
    assert log_ratio.grad.tolist()[0] == pytest.approx([0.0, 2.0, 0.0])
    assert plain_flag.tolist() == [[0.0, 0.0, 1.0]]


def test_dual_clip_goes_through_policy_loss_and_the_config():
    logp = torch.log(torch.tensor([[5.0]]))
    old, adv, mask = torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1)
    for name in ("grpo", "gspo", "dapo"):
        loss, _ = policy_loss(name, logp, old, adv, mask, **loss_params(
            AlgoConfig(name=name, eps_clip_c=3.0, eps_clip=0.2, eps_clip_high=0.2)))
        assert loss.item() == pytest.approx(3.0), name
    for name in ("cispo", "sapo"):
        with pytest.raises(ConfigError, match="dual-clip"):
            AlgoConfig(name=name, eps_clip_c=3.0)
    with pytest.raises(ConfigError, match="must be > 1"):
        AlgoConfig(eps_clip_c=0.5)


def test_cispo_weights_the_gradient_by_the_clipped_stopped_ratio():
    # ratios 2 (above 1 + 0.28: weight 1.28), 0.5 (no lower bound at eps_clip = 1: 0.5), 1
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[2.0, 0.5, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.ones(1, 3)
    params = loss_params(AlgoConfig(name="cispo", eps_clip=1.0, eps_clip_high=0.28))
    loss, metrics = policy_loss("cispo", logp, old, adv, mask, reduction="token_sum", **params)
    weights = [1.28, 0.5, 1.0]
    want = -sum(w * a * lp for w, a, lp in zip(weights, adv[0].tolist(), logp[0].tolist()))
    assert loss.item() == pytest.approx(want)
    loss.backward()
    # d/dlogp = -w * A: the weight carries no gradient of its own
    assert logp.grad.tolist()[0] == pytest.approx([-1.28, 1.0, -3.0])
    assert metrics["clipped_tokens"].item() == 1.0
