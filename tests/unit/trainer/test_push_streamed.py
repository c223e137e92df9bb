"""The step loop's push of a streamed export (trainer/main.py push_streamed): when rank 0's
stream was spent on a failed sync (the cohort re-formed and asks for the weights again), every
rank makes the export once more, in step, and rank 0 pushes it; otherwise one export. Two gloo
ranks; the export gathers (an all-reduce per tensor), as FSDP2's and megatron's do, so a rank
that exported a different number of times would hang or fail here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relax_slurm.trainer.export import sync_share
from tests.helpers_tiny import spawned_ranks
from relax_slurm.trainer.lead import Peer

TENSORS = 5


class Gathering:
    """A backend whose export all-reduces each tensor (every rank must iterate it)."""

    def __init__(self) -> None:
        self.exports = 0

    def engine_weights(self, stream: bool = False):
        self.exports += 1

        def export():
            for i in range(TENSORS):
                t = torch.full((3,), float(i))
                dist.all_reduce(t)
                yield f"w{i}", t
        return sync_share(export(), dist.get_rank(), collective=True, stream=stream)


class Lead:
    """Rank 0's side as the loop sees it: its first push finds the stream spent."""

    streams = True

    def __init__(self, spent: int) -> None:
        self.spent, self.pushed = spent, []

    def push(self, weights, version: int) -> dict:
        names = [n for n, _ in weights]  # reads the stream: the ranks gather in step
        self.pushed.append((version, names))
        return {"bytes": len(names)}

    def take_resend(self) -> bool:
        self.spent -= 1
        return self.spent >= 0

    def control_request(self) -> str | None:
        return "stop"  # told to every rank with the last resend answer


def _rank(rank: int, store: str, spent: int, queue) -> None:
    from relax_slurm.trainer.main import push_streamed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    backend = Gathering()
    if rank == 0:
        lead = Lead(spent)
        out = push_streamed(lead, lead.push, backend, 7)
        queue.put((0, backend.exports, lead.pushed, out))
    else:
        peer = Peer()
        out = push_streamed(peer, peer.push, backend, 7)
        queue.put((1, backend.exports, None, out))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spent", [0, 2])
def test_every_rank_exports_again_while_rank_zeros_stream_was_spent(tmp_path, spent):
    results = spawned_ranks(_rank, 2, str(tmp_path / "store"), spent)
    (_, exports0, pushed, out0), (_, exports1, _, out1) = results
    assert exports0 == exports1 == spent + 1
    assert pushed == [(7, [f"w{i}" for i in range(TENSORS)])] * (spent + 1)
    assert out0 == ({"bytes": TENSORS}, "stop") and out1 == ({}, "stop")
