"""Which sequence positions a megatron-core router sees on each rank (routing.py
`router_positions`) and the rollout's routing at them (`rollout_view`): checked against
megatron-core's own sequence split (tensor_parallel/mappings.py, called with a stand-in for the
TP group) and our context-parallel token selection (context_parallel.local_tokens)."""

from __future__ import annotations

import pytest
import torch

from relax_slurm.trainer.megatron.context_parallel import local_tokens
from relax_slurm.trainer.megatron.routing import TokenSplit, rollout_view, router_positions
from tests.conftest import NEEDS_MEGATRON


class Group:
    """What megatron's _split_along_first_dim reads of a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_without_parallelism_a_router_sees_the_whole_sequence():
    assert torch.equal(router_positions(7, TokenSplit()), torch.arange(7))


@NEEDS_MEGATRON
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_slices_are_megatrons_split(tp):
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    seq = torch.arange(4 * tp).view(-1, 1, 1).expand(-1, 3, 1)  # [S, B, 1]: its own position
    for r in range(tp):
        mine = _split_along_first_dim(seq, Group(tp, r))  # [S/TP, B, 1]
        got = router_positions(mine.shape[0], TokenSplit(sp=tp, sp_rank=r))
        assert torch.equal(got, mine[:, 0, 0])


@pytest.mark.parametrize("sp", [1, 2])
def test_context_parallel_chunks_then_the_sequence_split(sp):
    cp, width = 2, 16
    ids = torch.arange(width).view(1, -1)  # each token is its own position
    for c in range(cp):
        held, _ = local_tokens(ids, cp, c)  # [1, width / CP], what CP rank c runs
        rows = held.shape[1] // sp
        for r in range(sp):
            got = router_positions(rows, TokenSplit(sp=sp, sp_rank=r, cp=cp, cp_rank=c))
            assert torch.equal(got, held[0, r * rows:(r + 1) * rows])


def test_rollout_view_is_position_major_and_masks_the_padding():
    B, W, layers, K = 2, 5, 3, 2
    routed = torch.arange(B * W * layers * K, dtype=torch.int32).view(B, W, layers * K)
    valid = torch.ones(B, W, dtype=torch.bool)
    valid[1, 3:] = False  # a shorter row
    positions = torch.tensor([3, 4, 5])  # 5 is padding to a multiple of TP
    want, mask = rollout_view(routed, valid, positions, layer=1, topk=K)
    assert want.shape == (3 * B, K) and want.dtype == torch.int64
    per_layer = routed.view(B, W, layers, K)
    for i, p in enumerate([3, 4]):
        for b in range(B):  # token i * B + b, as megatron flattens [S, B]
            assert torch.equal(want[i * B + b], per_layer[b, p, 1].long())
    assert mask.tolist() == [True, False, True, False, False, False]
