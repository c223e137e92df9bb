"""Each trainer rank's share of what a weight sync sends (the export every backend makes)."""

from __future__ import annotations

from typing import Iterable, Iterator

from torch import Tensor


def sync_share(named: Iterable[tuple[str, Tensor]], rank: int, collective: bool,
               stream: bool = False) -> list | Iterator[tuple[str, Tensor]]:
    """This rank's share of what a weight sync sends: rank 0, the sender, gets every tensor:
    as a list, or with `stream` as the export itself, which the sender reads bucket by bucket
    as the ranks gather it (weightsync/sender.py), so no rank holds the whole model; any other
    rank keeps none. Where producing them is a collective (FSDP2's full_tensor(), megatron's
    gathers over TP/PP/EP) the other ranks drive it and drop each tensor as it comes, in step
    with rank 0's reading; else they skip it. (Every rank kept the whole model in a list
    before: a host copy of a 30B model per GPU.)"""
    if rank == 0:
        return iter(named) if stream else list(named)
    if collective:
        for _ in named:
            pass
    return []
