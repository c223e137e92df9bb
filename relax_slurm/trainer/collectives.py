"""Collectives on tensors the trainer builds from host values (metric sums, a control
request), created on the rank's device.

NCCL reduces only CUDA tensors: the first GPU run crashed in step 1 all-reducing a CPU tensor
of metric sums on the NCCL default group ("No backend type associated with device type cpu").
gloo takes both, so CPU runs never see the mistake; every trainer collective on a tensor made
here goes through this module, and tests/unit/trainer/test_collectives.py checks that no
other file of the trainer hands a collective a tensor built without a device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_DEVICE = torch.device("cpu")


def use_device(device: torch.device) -> None:
    """The device this rank's collectives use (ranks.init_distributed: cuda:LOCAL_RANK under
    NCCL, the CPU under gloo)."""
    global _DEVICE
    _DEVICE = device


def device() -> torch.device:
    return _DEVICE


def all_reduce_sum(values: Sequence[float | torch.Tensor], dtype: torch.dtype = torch.float64
                   ) -> list[float]:
    """Every rank's `values` (numbers, or scalar tensors still on the device) added
    elementwise, same length on every rank: one all-reduce, one read back to the host."""
    t = torch.stack([torch.as_tensor(v, dtype=dtype).to(_DEVICE).reshape(()) for v in values])
    dist.all_reduce(t)
    return t.tolist()


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank `src`'s `value` on every rank (the others pass anything)."""
    t = torch.tensor([value], dtype=torch.long, device=_DEVICE)
    dist.broadcast(t, src=src)
    return int(t.item())
