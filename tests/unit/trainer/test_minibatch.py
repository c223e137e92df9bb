"""trainer.num_steps_per_rollout: one rollout batch, several optimizer steps on its mini-batches,
the ratio measured against the policy before the first step. Checked against the same updates
taken by hand, one mini-batch at a time, on one gloo rank."""

from __future__ import annotations

import copy

import pytest
import torch

from relax_slurm.algos import policy_loss
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.batch import collate, loss_params, prepare_items
from relax_slurm.trainer.model import build_optimizer, single_process_group
from relax_slurm.trainer.step import (
    gather_logprobs, mini_batches, scaled_logits, train_step, with_old_logprobs,
)
from tests.unit.trainer.test_step import groups, tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():
        yield


def batch():
    algo = AlgoConfig()
    return collate(prepare_items(groups(), algo), 0, torch.device("cpu")), algo


def by_hand(model, whole, algo, num_steps: int, lr: float):
    """The mini-batch updates written out: old log-probs of the whole batch first, then per
    mini-batch k the loss sum(w_k * l) with w_k = num_steps x the batch weights (each
    mini-batch's weights sum to 1), one AdamW step each."""
    opt, _ = build_optimizer(model, TrainerConfig(lr=lr))
    with torch.no_grad():
        old = gather_logprobs(scaled_logits(model, whole, 1.0), whole.targets)
    size = len(whole) // num_steps
    losses = []
    for lo in range(0, len(whole), size):
        mb = whole.rows(lo, lo + size)
        opt.zero_grad()
        logp = gather_logprobs(scaled_logits(model, mb, 1.0), mb.targets)
        loss, _ = policy_loss(algo.name, logp, old[lo:lo + size, :logp.shape[1]],
                              mb.advantages, mb.weights * num_steps, mb.rollout_logp,
                              reduction="weighted_sum", **loss_params(algo))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_mini_batches_are_two_steps_against_the_first_policy():
    whole, algo = batch()
    lr = 1e-2  # large enough for the second mini-batch's ratio to leave 1 visibly
    model, twin = tiny_model(0), tiny_model(0)
    opt, sched = build_optimizer(model, TrainerConfig(lr=lr))
    calls = []
    step = opt.step

    def counted_step(*a, **k):
        calls.append("step")
        return step(*a, **k)

    opt.step = counted_step
    out = train_step(model, opt, sched, [(whole, True)], algo, micro_batch_size=4,
                     grad_clip=1.0, temperature=1.0, num_steps=2,
                     before_update=lambda: calls.append("before_update"))
    # the overlapped push joins before the first optimizer step, once
    assert calls == ["before_update", "step", "step"]
    losses = by_hand(twin, whole, algo, 2, lr)
    # same float32 operations up to the order of the micro-batch sums (4 rows vs one row set):
    # relative 1e-5 on the weights after two Adam steps of size lr
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # train/loss is the mean of the mini-batches' losses (each weighted to sum 1)
    assert out["train/loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert out["train/tokens"] == float((whole.weights != 0).sum())
    # the second mini-batch's ratio is against the policy before the first step: not 1
    assert out["train/clipfrac"] > 0


def test_the_first_mini_batch_ratio_is_one():
    whole, algo = batch()
    # old log-probs come from the same micro-batch cuts as the update: exactly the first
    # mini-batch's own log-probs, so its ratio is 1 bit for bit
    model = tiny_model(0)
    done = with_old_logprobs(model, whole, algo, 2, 3, 1.0)
    _, first = mini_batches(done, 2)[0]
    with torch.no_grad():
        own = gather_logprobs(scaled_logits(model, first.rows(0, 3), 1.0),
                              first.rows(0, 3).targets)
    assert torch.equal(first.rows(0, 3).old_logp, own)


def test_rows_that_do_not_split_are_refused():
    whole, algo = batch()
    with pytest.raises(ValueError, match="num_steps_per_rollout=3"):
        mini_batches(whole, 3)


def test_rollout_logprobs_stay_the_denominator_with_old_logprobs_rollout():
    whole, _ = batch()
    algo = AlgoConfig(old_logprobs="rollout")
    model = tiny_model(0)
    before = copy.deepcopy(model.state_dict())
    opt, sched = build_optimizer(model, TrainerConfig(lr=1e-3))
    out = train_step(model, opt, sched, [(whole, True)], algo, micro_batch_size=4,
                     grad_clip=1.0, temperature=1.0, num_steps=2)
    assert out["train/tokens"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_trainer_refuses_mini_batches_that_do_not_split_over_ranks():
    from relax_slurm.config.model import ModelConfig
    from relax_slurm.config.rollout import RolloutConfig
    from relax_slurm.config.schema import TrainConfig
    from relax_slurm.errors import ConfigError
    from relax_slurm.config.cross_checks import check_batch_divides

    cfg = TrainConfig(run_dir="x", model=ModelConfig(path="/m"),
                      rollout=RolloutConfig(batch_size=3, n_samples_per_prompt=4),
                      trainer=TrainerConfig(num_steps_per_rollout=4))
    check_batch_divides(cfg.rollout, cfg.trainer, 1)  # 12 rows: 4 mini-batches of 3
    with pytest.raises(ConfigError, match=r"num_steps_per_rollout=4 .*multiple of 8"):
        check_batch_divides(cfg.rollout, cfg.trainer, 2)  # 6 rows per rank do not cut into 4
