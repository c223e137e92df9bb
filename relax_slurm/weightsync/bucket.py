"""Split an ordered list of named tensors into buckets of about `bucket_mb`, one dtype each.

Pure: no I/O, no collectives. Each bucket becomes one /update_weights_from_distributed call
(names, dtypes, shapes) followed by one broadcast per tensor, so buckets bound how much an
engine allocates before it loads, and how many HTTP calls one sync costs.
"""

from __future__ import annotations

from typing import Sequence

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]],
                         bucket_mb: float) -> list[NamedTensors]:
    """Group by dtype (in order of first appearance), then cut each dtype's run, in the input
    order, into buckets of at most bucket_mb MiB. A tensor larger than that gets a bucket alone.
    No bucket is empty; every tensor appears exactly once.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb}: must be > 0 (weight_sync.bucket_mb)")
    limit = int(bucket_mb * 1024 * 1024)
    by_dtype: dict[torch.dtype, NamedTensors] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t))

    buckets: list[NamedTensors] = []
    for items in by_dtype.values():
        current: NamedTensors = []
        size = 0
        for name, t in items:
            n = tensor_nbytes(t)
            if current and size + n > limit:
                buckets.append(current)
                current, size = [], 0
            current.append((name, t))
            size += n
        if current:
            buckets.append(current)
    return buckets


def dtype_name(dtype: torch.dtype) -> str:
    """The string SGLang resolves with getattr(torch, name): torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")
