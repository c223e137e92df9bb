"""What each trainer rank keeps of a weight sync (trainer/export.py sync_share): rank 0 every
tensor, the others none; where the export is a collective (FSDP2, megatron) they drive it and
drop each tensor as it comes. Every rank kept the whole model before (issue #34: a host copy
of a 30B model per GPU)."""

from __future__ import annotations

import weakref

import pytest
import torch

from relax_slurm.trainer.export import sync_share

N = 50


class Export:
    """An export of N tensors that records how many of those it made are alive at once."""

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []
        self.most_alive = 0

    def __iter__(self):
        for i in range(N):
            t = torch.zeros(256)
            self.made.append(weakref.ref(t))
            self.most_alive = max(self.most_alive, sum(r() is not None for r in self.made))
            yield f"w{i}", t
            del t


def test_rank_zero_keeps_every_tensor():
    export = Export()
    kept = sync_share(export, rank=0, collective=True)
    assert [n for n, _ in kept] == [f"w{i}" for i in range(N)]


@pytest.mark.parametrize("collective", [True, False])
def test_other_ranks_keep_nothing_and_drive_only_a_collective_export(collective):
    export = Export()
    assert sync_share(export, rank=1, collective=collective) == []
    assert len(export.made) == (N if collective else 0)
    # the tensor being made and the one before it (still bound in the loop): never more
    assert export.most_alive <= 2, export.most_alive
