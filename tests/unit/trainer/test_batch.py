"""Batch preparation: advantages per group, weights over the whole batch, token alignment."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.samples import Sample
from relax_slurm.algos import policy_loss
from relax_slurm.trainer.batch import LOSS_KNOBS, collate, loss_params, prepare_items


def test_the_loss_knobs_are_the_algo_fields_policy_loss_takes_itself():
    """The trainer passes policy_loss these `algo.*` fields as keywords and the estimator's
    typed parameters as `params`: a knob added to one and not the other fails here."""
    own = {n for n, p in inspect.signature(policy_loss).parameters.items()
           if p.kind is p.KEYWORD_ONLY and n not in ("reduction", "params")}
    fields = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert set(LOSS_KNOBS) == own & fields
    cfg = AlgoConfig(name="sapo", tau_neg=2.0, entropy_coef=0.1)
    kwargs = loss_params(cfg)
    assert kwargs["params"] == cfg.estimator_params() and kwargs["entropy_coef"] == 0.1
    mine = cfg.estimator_params()
    assert loss_params(cfg, mine)["params"] is mine


def _sample(gid, prompt, response, reward, mask=None):
    return Sample(prompt_id=f"p{gid}", group_id=gid, prompt_ids=prompt, response_ids=response,
                  loss_mask=mask if mask is not None else [1.0] * len(response),
                  rollout_logprobs=[-0.5] * len(response), reward=reward)


def test_prepare_items_advantages_and_weights():
    groups = [[_sample(0, [1, 2], [3, 4], 1.0), _sample(0, [1, 2], [5], 0.0)],
              [_sample(1, [7], [8, 9, 9], 0.5), _sample(1, [7], [8], 0.5)]]
    items = prepare_items(groups, AlgoConfig(std_normalize=False))
    assert [it.advantage for it in items] == [0.5, -0.5, 0.0, 0.0]
    # weights of the whole batch sum to 1 (4 samples, each its token mean / 4)
    assert sum(float(it.weights.sum()) for it in items) == pytest.approx(1.0)
    assert np.allclose(items[0].weights, [0.125, 0.125])


def test_collate_aligns_response_tokens_with_their_predicting_position():
    groups = [[_sample(0, [1, 2, 3], [4, 5], 1.0, mask=[1.0, 0.0]), _sample(0, [1], [6], 0.0)]]
    items = prepare_items(groups, AlgoConfig(std_normalize=False, loss_reduction="token_mean"))
    mb = collate(items, pad_id=0, device=torch.device("cpu"))
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts input_ids[t+1]: response of sample 0 is predicted at 2 and 3
    assert mb.targets[0, 2].item() == 4 and mb.targets[0, 3].item() == 5
    assert mb.weights[0].tolist() == [0.0, 0.0, 0.5, 0.0]  # second response token masked out
    assert mb.weights[1].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert mb.advantages[0, 2].item() == 0.5 and mb.advantages[1, 0].item() == -0.5
    assert mb.rollout_logp[1, 0].item() == -0.5 and mb.rollout_logp[1, 1].item() == 0.0


def test_rows_cut_a_block_to_its_longest_sequence():
    groups = [[_sample(0, [1, 2, 3], [4, 5, 6], 1.0), _sample(0, [1], [6], 0.0),
               _sample(0, [1], [7, 8], 0.5)]]
    mb = collate(prepare_items(groups, AlgoConfig()), pad_id=0, device=torch.device("cpu"))
    assert mb.seq_lens == (6, 2, 3) == tuple(mb.attention_mask.sum(1).tolist())
    tail = mb.rows(1, 3)
    assert tail.seq_lens == (2, 3)  # the width comes from these, not from the device
    assert len(tail) == 2 and tail.input_ids.tolist() == [[1, 6, 0], [1, 7, 8]]
    assert tail.targets.tolist() == [[6, 0], [7, 8]]
    assert tail.weights.shape == (2, 2) and tail.teacher_logp is None
    assert torch.equal(tail.advantages, mb.advantages[1:3, :2])


@pytest.mark.parametrize("teacher", [False, True])
def test_collate_places_every_row_as_a_row_by_row_copy_would(teacher):
    """The batch-wide scatter gives the tensors a slice assignment per row gave, bit for bit
    (varied prompt and response lengths, empty responses, teacher log-probs or not)."""
    rng = np.random.default_rng(1)
    groups = []
    for g in range(6):
        group = []
        for _ in range(4):
            p, r = int(rng.integers(1, 9)), int(rng.integers(0, 7))
            group.append(Sample(
                prompt_id=f"p{g}", group_id=g, prompt_ids=rng.integers(1, 50, p),
                response_ids=rng.integers(1, 50, r), loss_mask=(rng.random(r) > 0.2) * 1.0,
                rollout_logprobs=-rng.random(r), reward=float(rng.random()),
                teacher_logprobs=-rng.random(r) if teacher else None))
        groups.append(group)
    items = prepare_items(groups, AlgoConfig())
    mb = collate(items, pad_id=99, device=torch.device("cpu"))
    T = max(len(it.sample.prompt_ids) + it.sample.response_len for it in items)
    ids = torch.full((len(items), T), 99, dtype=torch.long)
    per = {k: torch.zeros((len(items), T - 1)) for k in ("w", "adv", "lp", "t")}
    for i, it in enumerate(items):
        s = it.sample
        P, R = len(s.prompt_ids), s.response_len
        ids[i, :P] = torch.from_numpy(s.prompt_ids)
        ids[i, P:P + R] = torch.from_numpy(s.response_ids)
        span = slice(P - 1, P - 1 + R)
        per["w"][i, span] = torch.from_numpy(it.weights)
        per["adv"][i, span] = it.advantage
        per["lp"][i, span] = torch.from_numpy(s.rollout_logprobs)
        if teacher:
            per["t"][i, span] = torch.from_numpy(s.teacher_logprobs)
    assert torch.equal(mb.input_ids, ids) and torch.equal(mb.targets, ids[:, 1:])
    assert mb.attention_mask.tolist() == [
        [int(t < len(it.sample.prompt_ids) + it.sample.response_len) for t in range(T)]
        for it in items]
    assert torch.equal(mb.weights, per["w"]) and torch.equal(mb.advantages, per["adv"])
    assert torch.equal(mb.rollout_logp, per["lp"])
    assert (torch.equal(mb.teacher_logp, per["t"]) if teacher else mb.teacher_logp is None)
    assert mb.weights.dtype == mb.advantages.dtype == torch.float32
    assert mb.input_ids.dtype == mb.attention_mask.dtype == torch.long


def test_collate_places_routed_experts_as_a_row_by_row_copy_would():
    """The rollout's routing ([tokens, layers x top-k] int16 a sample, NOT_ROUTED -1 where a
    multi-turn sample's turn sent none) lands in [B, T, layers x top-k] int32 as one scatter,
    bit for bit what a copy per row gave; zeros past each row's prompt + response - 1."""
    rng = np.random.default_rng(2)
    width = 6  # 3 layers x top-2
    samples = []
    for g in range(5):
        p, r = int(rng.integers(2, 9)), int(rng.integers(0, 6))
        routed = rng.integers(0, 8, (p + r - 1) * width).astype(np.int16)
        if g == 3:
            routed[:width] = -1  # a position no turn's report covered
        samples.append(Sample(prompt_id=f"p{g}", group_id=g, prompt_ids=rng.integers(1, 50, p),
                              response_ids=rng.integers(1, 50, r), loss_mask=np.ones(r),
                              rollout_logprobs=-rng.random(r), reward=float(g % 2),
                              routed_experts=routed))
    items = prepare_items([[s] for s in samples], AlgoConfig())
    mb = collate(items, pad_id=0, device=torch.device("cpu"))
    T = max(len(it.sample.prompt_ids) + it.sample.response_len for it in items)
    want = torch.zeros((len(items), T, width), dtype=torch.int32)
    for i, it in enumerate(items):
        n = len(it.sample.prompt_ids) + it.sample.response_len - 1
        want[i, :n] = torch.from_numpy(it.sample.routed_experts.astype(np.int32).reshape(n, -1))
    assert mb.routed.dtype == torch.int32 and torch.equal(mb.routed, want)
    assert (mb.routed == -1).sum() == width


def test_collate_refuses_a_sample_without_a_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        collate(prepare_items([[_sample(0, [], [3], 1.0)]], AlgoConfig()), 0,
                torch.device("cpu"))
