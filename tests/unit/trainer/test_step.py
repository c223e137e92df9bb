"""train_step on one gloo rank: entropy, the reference model's KL, teacher log-probs, and every
metric policy_loss returns, reduced per trained token."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.samples import Sample
from relax_slurm.trainer.batch import collate, prepare_items
from relax_slurm.broker.stats import BatchStats
from relax_slurm.trainer.lead import batch_metrics, staleness_histogram
from relax_slurm.trainer.model import build_optimizer, single_process_group
from relax_slurm.trainer.step import (
    gather_logprobs, reduce_metrics, scaled_logits, token_entropy, train_step,
)

VOCAB = 16


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():  # a no-op if another test module set one up
        yield


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
    return Qwen3ForCausalLM(cfg)


def groups(teacher: bool = False) -> list[list[Sample]]:
    rng = np.random.default_rng(0)
    out = []
    for gid in range(2):
        group = []
        for i in range(4):
            r = int(rng.integers(1, 5))
            response = rng.integers(3, VOCAB, r)
            group.append(Sample(
                prompt_id=str(gid), group_id=gid, prompt_ids=[3 + gid, 4, 5],
                response_ids=response, loss_mask=np.ones(r), rollout_logprobs=-np.ones(r),
                teacher_logprobs=-0.25 * np.arange(1, r + 1) if teacher else None,
                reward=float(i % 2)))
        out.append(group)
    return out


def step(model, items, algo, ref_model=None):
    opt, sched = build_optimizer(model, TrainerConfig(lr=1e-3))
    batch = collate(items, 0, torch.device("cpu"))
    return train_step(model, opt, sched, [(batch, True)], algo, micro_batch_size=3, grad_clip=1.0,
                      temperature=1.0, ref_model=ref_model)


def expected_mean(model, items, fn) -> float:
    """Token mean of fn(logits, batch) over every trained token, computed directly."""
    mb = collate(items, 0, torch.device("cpu"))
    with torch.no_grad():
        values = fn(scaled_logits(model, mb, 1.0), mb)
    mask = mb.weights != 0
    return float(values[mask].mean())


def test_entropy_and_loss_metrics_are_logged_every_step():
    model = tiny_model(0)
    items = prepare_items(groups(), AlgoConfig())
    want = expected_mean(model, items, lambda logits, mb: token_entropy(logits))
    out = step(model, items, AlgoConfig())
    assert out["train/entropy"] == pytest.approx(want, rel=1e-5)
    assert out["train/tokens"] == sum(it.sample.response_len for it in items)
    for key in ("train/loss", "train/grad_norm", "train/clipfrac", "train/lr",
                "train/rollout_train_logprob_diff"):
        assert key in out
    assert "train/kl_loss" not in out and "train/opd_reverse_kl" not in out


def test_entropy_bonus_changes_the_gradient():
    items = prepare_items(groups(), AlgoConfig())
    grads = []
    for coef in (0.0, 0.5):
        model = tiny_model(0)
        step(model, items, AlgoConfig(entropy_coef=coef))
        grads.append(model.model.embed_tokens.weight.detach().clone())
    assert not torch.allclose(grads[0], grads[1])


def test_kl_loss_against_a_frozen_reference():
    model, ref = tiny_model(0), tiny_model(1).eval().requires_grad_(False)
    algo = AlgoConfig(kl_loss_coef=0.1, kl_loss_type="k3")
    items = prepare_items(groups(), algo)

    def k3(logits, mb):
        logp = gather_logprobs(logits, mb.targets)
        ref_logp = gather_logprobs(scaled_logits(ref, mb, 1.0), mb.targets)
        r = ref_logp - logp
        return torch.exp(r) - r - 1

    want = expected_mean(model, items, k3)
    ref_before = copy.deepcopy(ref.state_dict())
    out = step(model, items, algo, ref_model=ref)
    assert out["train/kl_loss"] == pytest.approx(want, rel=1e-5) and want > 0
    for name, t in ref.state_dict().items():  # the reference never moves
        assert torch.equal(t, ref_before[name])
    # the same weights as the reference: no divergence
    twin = tiny_model(0)
    out = step(twin, items, algo, ref_model=tiny_model(0).eval().requires_grad_(False))
    assert out["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)


def test_teacher_logprobs_reach_the_opd_loss():
    model = tiny_model(0)
    algo = AlgoConfig(name="opd")
    items = prepare_items(groups(teacher=True), algo)
    mb = collate(items, 0, torch.device("cpu"))
    # collate puts response token j's teacher log-prob where the trainer predicts it
    s = items[0].sample
    P, R = len(s.prompt_ids), s.response_len
    assert mb.teacher_logp[0, P - 1:P - 1 + R].tolist() == pytest.approx(
        s.teacher_logprobs.tolist())
    want = expected_mean(model, items,
                         lambda logits, mb: gather_logprobs(logits, mb.targets) - mb.teacher_logp)
    out = step(model, items, algo)
    assert out["train/opd_reverse_kl"] == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        step(tiny_model(0), prepare_items(groups(), algo), algo)


def test_a_batch_mixing_samples_with_and_without_teacher_is_refused():
    mixed = [groups(teacher=True)[0], groups()[1]]
    items = prepare_items(mixed, AlgoConfig())
    with pytest.raises(ValueError, match="teacher log-probs"):
        collate(items, 0, torch.device("cpu"))


def test_reduce_metrics_names_and_divides_by_tokens():
    out = reduce_metrics({"loss": 0.5, "tokens": 10.0, "clipped_tokens": 2.0,
                          "logprob_abs_diff": 1.0, "tis_masked_tokens": 5.0, "entropy": 20.0,
                          "kl_loss": 3.0, "opd_reverse_kl": -4.0, "opsm_masked_tokens": 1.0})
    assert out == pytest.approx({
        "train/loss": 0.5, "train/tokens": 10.0, "train/clipfrac": 0.2,
        "train/rollout_train_logprob_diff": 0.1, "train/tis_masked_frac": 0.5,
        "train/entropy": 2.0, "train/kl_loss": 0.3, "train/opd_reverse_kl": -0.4,
        "train/opsm_masked_frac": 0.1})


def test_batch_metrics_count_reward_errors_and_filtered_groups():
    gs = groups()
    for g, (errors, filtered) in zip(gs, [(2, 1), (1, 3)]):
        for s in g:
            s.metadata.update(worker=0, reward_errors=errors, filtered_groups=filtered)
    out = batch_metrics(gs, BatchStats.empty())
    assert out["rollout/reward_errors"] == 3 and out["rollout/filtered_groups"] == 4
    assert batch_metrics(groups(), BatchStats.empty())["rollout/reward_errors"] == 0  # no worker's


def test_batch_metrics_time_generation_and_scoring():
    """perf/gen_time_s spans the batch's generations; perf/score_time_s is the mean per group
    of the time from its last response to its rewards (a slow reward shows there)."""
    gs = groups()
    for g, (start, end, scored) in zip(gs, [(10.0, 12.0, 12.5), (11.0, 14.0, 15.5)]):
        for s in g:
            s.metadata.update(worker=0, t_start=start, t_end=end, t_scored=scored)
    out = batch_metrics(gs, BatchStats.empty())
    assert out["perf/gen_time_s"] == 4.0 and out["perf/score_time_s"] == 1.0
    for s in gs[1]:  # a proxy's group has no scoring stamp: left out, not counted as 0
        del s.metadata["t_scored"]
    assert batch_metrics(gs, BatchStats.empty())["perf/score_time_s"] == 0.5


def test_staleness_histogram_has_every_bucket_as_a_share():
    # msgpack may hand the broker's int keys back as ints or (from JSON) as strings
    # (a key as a string: normalised)
    stats = dataclasses.replace(BatchStats.empty(), staleness_hist={0: 24, "2": 8})
    assert staleness_histogram(stats, 2) == {"broker/staleness_hist/0": 0.75,
                                             "broker/staleness_hist/1": 0.0,
                                             "broker/staleness_hist/2": 0.25}
    assert staleness_histogram(BatchStats.empty(), 0) == {"broker/staleness_hist/0": 0.0}
