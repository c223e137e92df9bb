"""algo=ppo's critic on the torch backend (one gloo rank, the tiny model): the advantages it
hands the policy, that it learns the returns, and that it is checkpointed and resumed exactly
with the policy."""

from __future__ import annotations

import pytest
import torch

from relax_slurm.algos.ppo import whiten
from relax_slurm.checkpoint import dcp, find_latest, save_checkpoint
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.backend import TorchBackend
from relax_slurm.trainer.batch import collate, prepare_items
from relax_slurm.trainer.critic import reward_kl
from relax_slurm.trainer.model import single_process_group
from tests.unit.trainer.test_step import groups

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():
        yield
    dcp._ckpt_group = None  # the cached checkpoint group lived in the group just destroyed


def config(tiny_dir, **algo) -> TrainConfig:
    return TrainConfig(
        run_dir="unused", model=ModelConfig(path=str(tiny_dir)),
        algo=AlgoConfig(name="ppo", critic_lr=1e-2, **algo),
        rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=4),
        trainer=TrainerConfig(lr=1e-2, nproc_per_node=1, micro_batch_size=3))


def batch(backend: TorchBackend, seed: int = 0):
    items = prepare_items(groups(), backend.cfg.algo)
    for it in items:  # vary the scores per step so every step moves the weights
        it.advantage += seed
    return collate(items, backend.pad_id, CPU)


def test_first_advantages_are_the_whitened_scores(tiny_dir):
    """The value head starts at 0: with gamma = lam = 1 every token's advantage is its sample's
    score, whitened over the batch's trained tokens; the returns are the score."""
    backend = TorchBackend(config(tiny_dir), CPU)
    block = batch(backend)
    [(out, last)] = backend.critic.prepare([(block, True)], None)
    assert last and torch.equal(out.old_values, torch.zeros_like(block.weights))
    mask = block.weights != 0
    assert torch.equal(out.returns, torch.where(mask, block.advantages, 0.0))
    assert torch.allclose(out.advantages, whiten(block.advantages, mask), atol=1e-6)
    assert out.advantages[mask].mean().abs() < 1e-6


def test_reward_side_kl_enters_the_returns(tiny_dir):
    """algo.kl_coef: with V = 0 and gamma = lam = 1 each return is the score minus kl_coef x
    the KL to go of the policy (before the step) to the reference."""
    from relax_slurm.algos.common import kl_to_go
    from relax_slurm.trainer.step import token_logprobs

    backend = TorchBackend(config(tiny_dir, kl_coef=0.5, kl_loss_type="k1"), CPU)
    with torch.no_grad():  # a reference away from the policy
        for p in backend.ref_model.parameters():
            p.mul_(1.5)
    block = batch(backend)
    [(out, _)] = backend.critic.prepare(
        [(block, True)], reward_kl(backend.cfg, backend.model, backend.ref_model))
    with torch.no_grad():
        to_go = kl_to_go(token_logprobs(backend.model, block, 1.0),
                         token_logprobs(backend.ref_model, block, 1.0), block.weights, "k1")
    mask = block.weights != 0
    expected = torch.where(mask, block.advantages - 0.5 * to_go, 0.0)
    assert to_go[mask].abs().max() > 0.01
    assert torch.allclose(out.returns, expected, atol=1e-5)
    assert "train/reward_kl" in backend.train_step([(batch(backend), True)])


def test_the_critic_learns_the_returns(tiny_dir):
    backend = TorchBackend(config(tiny_dir, value_clip=None), CPU)
    losses = [backend.train_step([(batch(backend), True)])["critic/vf_loss"] for _ in range(15)]
    # V = 0 at first: 0.5 x mean(score^2) = 0.25 (scores 0 and 1, half each, per token)
    assert losses[0] == pytest.approx(0.25, rel=0.2)
    assert losses[-1] < losses[0] / 2, losses


def test_value_clip_bites_from_the_second_mini_batch(tiny_dir):
    """With one optimizer step per batch the critic's values are V_old when the loss is taken
    (nothing to clip); with trainer.num_steps_per_rollout=2 the second mini-batch's values moved
    with the first step, and a tiny clip range catches them."""
    for clip, clipped in ((None, False), (1e-4, True)):
        cfg = config(tiny_dir, value_clip=clip)
        cfg.trainer.num_steps_per_rollout = 2
        backend = TorchBackend(cfg, CPU)
        assert (backend.train_step([(batch(backend), True)])["critic/vf_clipfrac"] > 0) == clipped
    one = TorchBackend(config(tiny_dir, value_clip=1e-4), CPU)
    assert all(one.train_step([(batch(one, s), True)])["critic/vf_clipfrac"] == 0.0
               for s in range(2))


def test_resume_restores_the_critic_exactly(tiny_dir, tmp_path):
    straight = TorchBackend(config(tiny_dir), CPU)
    for seed in range(3):
        straight.train_step([(batch(straight, seed), True)])
    straight.save(tmp_path, 3, {}, keep_last=1, async_save=False, hf_assets_src=None)

    resumed = TorchBackend(config(tiny_dir), CPU)
    assert resumed.load(find_latest(tmp_path))["critic_saved"]
    for k, v in resumed.critic.model.state_dict().items():
        assert torch.equal(v, straight.critic.model.state_dict()[k]), k
    # step 4 on both: the same computation on the same weights and Adam states, bit for bit
    a = straight.train_step([(batch(straight, 3), True)])
    b = resumed.train_step([(batch(resumed, 3), True)])
    assert a["critic/vf_loss"] == b["critic/vf_loss"] > 0
    assert a["train/loss"] == b["train/loss"]
    for model in ("model", "critic"):
        x = straight.model if model == "model" else straight.critic.model
        y = resumed.model if model == "model" else resumed.critic.model
        for (k, p), (_, q) in zip(x.state_dict().items(), y.state_dict().items()):
            assert torch.equal(p, q), (model, k)


def test_a_checkpoint_without_critic_leaves_it_fresh(tiny_dir, tmp_path):
    grpo = TorchBackend(config(tiny_dir).__class__(
        run_dir="unused", model=ModelConfig(path=str(tiny_dir)),
        trainer=TrainerConfig(nproc_per_node=1)), CPU)
    save_checkpoint(tmp_path, 1, grpo.model, grpo.optimizer, grpo.scheduler, {}, keep_last=1)
    ppo = TorchBackend(config(tiny_dir), CPU)
    extra = ppo.load(find_latest(tmp_path))
    assert "critic_saved" not in extra
    assert all(torch.equal(v, torch.zeros_like(v))
               for k, v in ppo.critic.model.state_dict().items() if "value_head" in k)


@pytest.mark.parametrize("overrides,key", [
    ({"gamma": 1.5}, "algo.gamma"), ({"lam": -0.1}, "algo.lam"),
    ({"value_clip": 0.0}, "algo.value_clip"), ({"critic_lr": 0.0}, "algo.critic_lr"),
])
def test_bad_critic_knobs_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        AlgoConfig(name="ppo", **overrides)


def test_ppo_is_refused_where_the_critic_is_not_built(tiny_dir):
    # the megatron critic: TP/DP/EP, not pipeline stages (test_presets.py checks CP too)
    with pytest.raises(ConfigError, match=r"algo=ppo with trainer=megatron and trainer."
                                          r"pipeline_parallel_size=2: .*algorithms.md"):
        TrainConfig(run_dir="x", model=ModelConfig(path=str(tiny_dir)),
                    algo=AlgoConfig(name="ppo"),
                    trainer=TrainerConfig(backend="megatron", pipeline_parallel_size=2,
                                          nproc_per_node=2))
    with pytest.raises(ConfigError, match=r"streaming=true .*algo=ppo .*whitened"):
        TrainConfig(run_dir="x", model=ModelConfig(path=str(tiny_dir)),
                    algo=AlgoConfig(name="ppo", max_staleness=1, loss_reduction="token_sum"),
                    trainer=TrainerConfig(streaming=True))


def test_async_save_holds_the_critic(tiny_dir, tmp_path):
    """trainer.async_save: the critic's tensors are staged with the policy's before the save
    returns, so training on does not change what is written."""
    backend = TorchBackend(config(tiny_dir), CPU)
    backend.train_step([(batch(backend), True)])
    saved = {k: v.clone() for k, v in backend.critic.model.state_dict().items()}
    handle = backend.save(tmp_path, 1, {}, keep_last=1, async_save=True, hf_assets_src=None)
    backend.train_step([(batch(backend, 1), True)])  # moves the critic while the write runs
    handle.wait()
    fresh = TorchBackend(config(tiny_dir), CPU)
    fresh.load(find_latest(tmp_path))
    for k, v in fresh.critic.model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_critic_warmup_leaves_the_policy_alone(tiny_dir):
    backend = TorchBackend(config(tiny_dir, critic_warmup_steps=2), CPU)
    start = {k: v.clone() for k, v in backend.model.state_dict().items()}
    critic_start = {k: v.clone() for k, v in backend.critic.model.state_dict().items()}
    for seed in range(2):
        out = backend.train_step([(batch(backend, seed), True)])
        assert out["train/critic_warmup"] == 1.0 and "critic/vf_loss" in out
    assert all(torch.equal(v, start[k]) for k, v in backend.model.state_dict().items())
    assert not all(torch.equal(v, critic_start[k])
                   for k, v in backend.critic.model.state_dict().items())
    assert backend.scheduler.last_epoch == 2  # the lr schedule counted the warmup batches
    assert "train/loss" in backend.train_step([(batch(backend, 2), True)])
    assert not all(torch.equal(v, start[k]) for k, v in backend.model.state_dict().items())
    with pytest.raises(ConfigError, match=r"algo\.critic_warmup_steps=2 .*algo=grpo"):
        AlgoConfig(critic_warmup_steps=2)
