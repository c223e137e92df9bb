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
