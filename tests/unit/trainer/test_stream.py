"""Streaming training (trainer/stream.py): blocks as groups arrive give the whole batch's update.

One gloo rank, a tiny Qwen3: the same groups trained as one whole batch and as a stream of
groups arriving one by one (in group-id order) produce bit-identical gradients, weights and
metrics; blocks are cut at data ranks x micro_batch_size rows, the last flagged; the broker
stats of several takes merge into one batch's.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.samples import Group, Sample
from relax_slurm.trainer.model import build_optimizer, single_process_group
from relax_slurm.trainer.step import train_step
from relax_slurm.broker.stats import BatchStats, Counters
from relax_slurm.trainer.stream import GroupStream, step_blocks

VOCAB, N = 16, 4


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():
        yield


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
    return Qwen3ForCausalLM(cfg)


def make_groups(n_groups: int = 4) -> list[Group]:
    rng = np.random.default_rng(1)
    out = []
    for gid in range(n_groups):
        group = []
        for i in range(N):
            r = int(rng.integers(1, 7))  # unequal lengths: blocks pad differently
            group.append(Sample(
                prompt_id=str(gid), group_id=gid, prompt_ids=[3 + gid, 4, 5],
                response_ids=rng.integers(3, VOCAB, r), loss_mask=np.ones(r),
                rollout_logprobs=-np.ones(r), reward=float(rng.integers(0, 2)) + 0.1 * i))
        out.append(group)
    return out


def taken(hist: dict[int, int], most: int, **counters: int) -> BatchStats:
    """A take's stats: its staleness counts and largest value, the named counters (others 0)."""
    return BatchStats(staleness_hist=hist, staleness_max=most, staleness_mean=0.0,
                      counters=dataclasses.replace(Counters.zero(), **counters))


class Arrivals:
    """The broker's side of a stream: groups become available `per_take` at a time."""

    def __init__(self, groups: list[Group], per_take: int) -> None:
        self.queue, self.per_take = list(groups), per_take
        self.calls: list[tuple[int, int]] = []

    def __call__(self, num_groups: int, min_groups: int) -> tuple[list[Group], BatchStats]:
        self.calls.append((num_groups, min_groups))
        n = max(min_groups, min(self.per_take, num_groups))
        got, self.queue = self.queue[:n], self.queue[n:]
        stale = {0: len(got) * N}
        return got, taken(stale, 0, queue_depth=len(self.queue))


def train(groups: list[Group], streaming: bool, per_take: int, algo: AlgoConfig,
          micro_batch_size: int = 3):
    model = tiny_model()
    opt, sched = build_optimizer(model, TrainerConfig(lr=1e-3))
    arrivals = Arrivals(groups, per_take)
    stream = GroupStream(arrivals, algo, len(groups), N, block_rows=micro_batch_size,
                         streaming=streaming)
    grads = {}

    def keep_grads() -> None:
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    metrics = train_step(model, opt, sched, step_blocks(stream, 0, torch.device("cpu"), [0]),
                         algo, micro_batch_size=micro_batch_size, grad_clip=1.0,
                         temperature=1.0, before_update=keep_grads)
    return model, grads, metrics, stream, arrivals


@pytest.mark.parametrize("reduction", ["seq_mean_token_mean", "token_sum"])
def test_streamed_groups_give_the_whole_batch_update_bit_for_bit(reduction):
    algo = AlgoConfig(name="grpo", loss_reduction=reduction)
    groups = make_groups()
    whole, g_whole, m_whole, s_whole, a_whole = train(copy.deepcopy(groups), False, 99, algo)
    streamed, g_stream, m_stream, s_stream, a_stream = train(copy.deepcopy(groups), True, 1, algo)
    # whole: one take of every group, one block; streamed: a take per group, 16 rows in blocks
    # of 3 cut across groups, the step's last block flagged
    assert a_whole.calls == [(4, 4)] and s_whole.blocks == 1
    assert a_stream.calls == [(4, 1), (3, 1), (2, 1), (1, 1)] and s_stream.blocks == 6
    assert g_whole.keys() == g_stream.keys()
    for name in g_whole:
        assert torch.equal(g_whole[name], g_stream[name]), name
    for (name, a), (_, b) in zip(whole.named_parameters(), streamed.named_parameters()):
        assert torch.equal(a, b), name
    assert m_whole == m_stream
    gw, sw = s_whole.batch()
    gs, ss = s_stream.batch()
    assert [g[0].group_id for g in gw] == [g[0].group_id for g in gs] == [0, 1, 2, 3]
    assert sw.staleness_hist == ss.staleness_hist == {0: 16}


def test_blocks_are_cut_at_whole_micro_batches_and_the_last_is_flagged():
    groups = make_groups(3)  # 12 rows, blocks of 5: 5, 5, 2
    arrivals = Arrivals(groups, 2)
    stream = GroupStream(arrivals, AlgoConfig(), 3, N, block_rows=5, streaming=True)
    sizes = []
    while True:
        items, last = stream.next_block()
        sizes.append((len(items), last))
        if last:
            break
    assert sizes == [(5, False), (5, False), (2, True)]
    # every sample's weight divides by the step's 12 samples, not by the 8 of the first take
    first = stream.groups[0][0]
    assert stream.batch_samples == 12
    assert arrivals.calls == [(3, 1), (1, 1)]
    assert first.group_id == 0


def test_a_group_of_the_wrong_size_is_refused():
    groups = make_groups(2)
    groups[1] = groups[1][:3]
    stream = GroupStream(Arrivals(groups, 2), AlgoConfig(), 2, N, block_rows=4, streaming=True)
    with pytest.raises(ValueError, match="group 1 has 3 samples, not rollout.n_samples_per_prompt=4"):
        stream.next_block()


def test_merged_stats_of_several_takes():
    merged = BatchStats.merge([
        taken({0: 4, 1: 4}, 1, queue_depth=3, consumed=2),
        taken({1: 2, 2: 6}, 2, queue_depth=0, consumed=4),
    ])
    assert merged.staleness_hist == {0: 4, 1: 6, 2: 6}
    assert merged.staleness_max == 2
    assert merged.staleness_mean == pytest.approx((6 + 12) / 16)  # (1*6 + 2*6) / 16
    assert (merged.counters.queue_depth, merged.counters.consumed) == (0, 4)  # the last take's
