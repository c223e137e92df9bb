"""On-policy distillation on any estimator: the teacher term joins whatever advantages the
estimator gives, checked against values worked out by hand."""

import pytest
import torch

from relax_slurm.algos import policy_loss
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.errors import ConfigError

OLD = torch.tensor([[-1.0, -2.0, -0.5]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5]])  # student - teacher = [0.5, -1.0, 0.0]
MASK = torch.ones(1, 3)


def test_teacher_term_on_gspo_by_hand():
    logp = OLD.clone().requires_grad_(True)  # sequence ratio 1: loss = -mean_t(A'_t)
    adv = torch.ones(1, 3)
    loss, m = policy_loss("gspo", logp, OLD, adv, MASK, teacher_logprobs=TEACHER,
                          opd_kl_coef=0.5, eps_clip=3e-4, eps_clip_high=4e-4)
    # A' = 1 - 0.5 * [0.5, -1, 0] = [0.75, 1.5, 1.0]
    assert loss.item() == pytest.approx(-(0.75 + 1.5 + 1.0) / 3, rel=1e-6)
    assert m["opd_reverse_kl"].item() == pytest.approx(-0.5)


def test_teacher_term_on_cispo_weights_each_tokens_logp():
    logp = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss("cispo", logp, OLD, torch.zeros(1, 3), MASK, teacher_logprobs=TEACHER,
                          opd_kl_coef=1.0, eps_clip=1.0, eps_clip_high=0.28)
    # cispo: -sg(ratio) * A' * logp with ratio 1 and A' = -[0.5, -1, 0]
    # = -(-0.5 * -1 + 1 * -2 + 0 * -0.5) / 3 = -(0.5 - 2) / 3
    assert loss.item() == pytest.approx(1.5 / 3, rel=1e-6)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.5 / 3, -1.0 / 3, 0.0])


def test_only_reward_drops_the_task_advantage_on_any_estimator():
    logp = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss("sapo", logp, OLD, torch.full((1, 3), 7.0), MASK,
                          teacher_logprobs=TEACHER, opd_kl_coef=1.0, opd_only_reward=True)
    # A' = -[0.5, -1, 0]; sapo at ratio 1: f(1) = 4/tau * sigmoid(0) = 2/tau, loss = -f * A'
    # with tau_pos = 1 where A' > 0 and tau_neg = 1.05 elsewhere
    want = -(2 / 1.05 * -0.5 + 2 / 1.0 * 1.0 + 2 / 1.05 * 0.0) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)


def test_opd_alias_insists_on_teacher_logprobs_others_do_not():
    with pytest.raises(ValueError, match="algo=opd needs the teacher"):
        policy_loss("opd", OLD, OLD, torch.ones(1, 3), MASK)
    loss, m = policy_loss("grpo", OLD, OLD, torch.ones(1, 3), MASK)
    assert "opd_reverse_kl" not in m


def test_config_distills_on_any_estimator_and_with_the_agent_proxy():
    for name in ("gspo", "cispo", "rloo"):
        assert AlgoConfig(name=name, teacher_model_path="/t").teacher_model_path == "/t"
    AlgoConfig(name="grpo", teacher_model_path="/t", opd_only_reward=True)
    with pytest.raises(ConfigError, match=r"opd_only_reward=true .*teacher_model_path"):
        AlgoConfig(name="grpo", opd_only_reward=True)
    cfg = TrainConfig(run_dir="x", model=ModelConfig(path="/m"),
                      algo=AlgoConfig(name="gspo", teacher_model_path="/t"),
                      rollout=RolloutConfig(agent_mode="proxy"))
    assert cfg.algo.teacher_model_path == "/t"
