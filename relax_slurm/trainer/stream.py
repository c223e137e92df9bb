"""A step's batch as blocks of rows: the whole batch at once, or groups as they arrive.

Streaming (`trainer.streaming`, async runs): the trainer does not wait for the batch's last
group (the long tail of generation) before its first forward. Rank 0 takes whatever complete
groups the broker has queued (`get_batch` with `min_groups=1`), computes their advantages (per
group: only estimators that need nothing from other groups stream) and loss weights (divided by
the step's known sample count), and hands out a block of `data ranks x micro_batch_size` rows
as soon as it has one; every rank runs forward/backward on its micro-batch of it, and the
optimizer steps after the block marked last. The gradient is the same sum as the whole batch's,
so the update is the same; for one data rank, groups arriving in group-id order give the whole
batch's micro-batches in the same order, bit for bit (tests/unit/trainer/test_stream.py).

Whole batches (sync runs, and where streaming does not apply) are the one-block case: rank 0
fetches every group, sorts them by group id, and the single block is the whole batch, scattered
as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from relax_slurm.broker.stats import BatchStats
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.algo_params import EstimatorParams
from relax_slurm.samples import Group
from relax_slurm.trainer.batch import (
    MicroBatch, TrainItem, collate, mini_batch_order, prepare_items, scatter_batch,
)

# take(num_groups, min_groups) -> (groups, stats); blocks until min_groups are queued
Take = Callable[[int, int], tuple[list[Group], BatchStats]]


class GroupStream:
    """Rank 0: one step's groups from the broker, cut into blocks of rows for every rank."""

    def __init__(self, take: Take, algo: AlgoConfig, num_groups: int, samples_per_group: int,
                 block_rows: int, streaming: bool, params: EstimatorParams | None = None
                 ) -> None:
        self.take, self.algo = take, algo
        # the estimator's typed parameters: the lead's, built once per run
        self.params = algo.estimator_params() if params is None else params
        self.num_groups, self.samples_per_group = num_groups, samples_per_group
        self.block_rows = block_rows
        self.streaming = streaming
        self.groups: list[Group] = []
        self.stats: list[BatchStats] = []
        self.pending: list[TrainItem] = []
        self.blocks = 0
        self.wait_s = 0.0
        """Time spent waiting for groups (the part of the step generation was not hidden)."""

    @property
    def batch_samples(self) -> int:
        return self.num_groups * self.samples_per_group

    def _take_more(self) -> None:
        missing = self.num_groups - len(self.groups)
        t = time.monotonic()
        groups, stats = self.take(missing, 1 if self.streaming else missing)
        self.wait_s += time.monotonic() - t
        for g in groups:
            if len(g) != self.samples_per_group:
                raise ValueError(f"group {g[0].group_id} has {len(g)} samples, not "
                                 f"rollout.n_samples_per_prompt={self.samples_per_group}: loss "
                                 "weights are divided by the step's sample count")
        groups = sorted(groups, key=lambda g: g[0].group_id)  # arrival order is timing
        self.groups.extend(groups)
        self.stats.append(stats)
        self.pending.extend(prepare_items(groups, self.algo, self.batch_samples,
                                          self.params))

    def fill(self) -> None:
        """Take every group of the step now (whole-batch mode: before engines release memory)."""
        while len(self.groups) < self.num_groups:
            self._take_more()

    def next_block(self) -> tuple[list[TrainItem], bool]:
        """The next block of rows and whether it is the step's last."""
        if not self.streaming:
            self.fill()
        while True:
            complete = len(self.groups) == self.num_groups
            if complete and len(self.pending) <= self.block_rows or not self.streaming:
                block, self.pending = self.pending, []
                self.blocks += 1
                return block, True
            if len(self.pending) >= self.block_rows:
                block = self.pending[:self.block_rows]
                self.pending = self.pending[self.block_rows:]
                self.blocks += 1
                return block, False
            self._take_more()

    def batch(self) -> tuple[list[Group], BatchStats]:
        """Every group trained this step (by group id) and the broker stats of the step."""
        return sorted(self.groups, key=lambda g: g[0].group_id), BatchStats.merge(self.stats)


def step_blocks(stream: GroupStream | None, pad_id: int, device: torch.device,
                data_ranks: list[int], num_steps: int = 1) -> Iterator[tuple[MicroBatch, bool]]:
    """Every rank: (its rows of the next block, last?) until the step's last block. Rank 0
    passes its stream and collates; the others pass None. Collective per block. `num_steps`
    (trainer.num_steps_per_rollout, whole batches only): the rows are laid out so that each
    mini-batch is the same slice of the batch on any number of data ranks
    (`mini_batch_order`)."""
    while True:
        whole, last = None, False
        if dist.get_rank() == 0:
            items, last = stream.next_block()
            order = mini_batch_order(len(items), len(set(data_ranks)), num_steps)
            whole = collate([items[i] for i in order], pad_id, torch.device("cpu"))
        block = scatter_batch(whole, device, data_ranks)
        flag = torch.tensor([int(last)], device=device)
        dist.broadcast(flag, src=0)
        yield block, bool(flag.item())
        if flag.item():
            return
