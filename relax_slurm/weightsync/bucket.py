"""Split an ordered list of named tensors into buckets of about `bucket_mb`, one dtype each,
and flatten a bucket into one byte buffer (and back).

Pure: no I/O, no collectives. Each bucket becomes one /update_weights_from_distributed call
(names, dtypes, shapes) followed by one broadcast per tensor, or with
load_format=flattened_bucket by one broadcast of the bucket's bytes, so buckets bound how much
an engine allocates before it loads, and how many HTTP calls one sync costs.

The flattened layout is SGLang's (`FlattenedTensorBucket`, 0.5.x): every tensor's contiguous
bytes (`flatten().view(torch.uint8)`), end to end in the order of `names`, no padding.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]],
                         bucket_mb: float) -> list[NamedTensors]:
    """Buckets of at most bucket_mb MiB, one dtype each, in the input order within a dtype
    (`stream_buckets`, all at once). A tensor larger than that gets a bucket alone. No bucket
    is empty; every tensor appears exactly once."""
    return list(stream_buckets(named_tensors, bucket_mb))


def stream_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float
                   ) -> Iterator[NamedTensors]:
    """`bucket_named_tensors` for tensors as they come (an export that gathers each in turn):
    one open bucket per dtype, each given out once the next tensor of its dtype would overflow
    it, the rest at the end. So at most one open bucket per dtype is held, never the whole
    model; every tensor appears exactly once, and a bucket holds one dtype, in input order."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb}: must be > 0 (weight_sync.bucket_mb)")
    limit = int(bucket_mb * 1024 * 1024)
    open_: dict[torch.dtype, tuple[NamedTensors, int]] = {}
    for name, t in named_tensors:
        current, size = open_.get(t.dtype, ([], 0))
        n = tensor_nbytes(t)
        if current and size + n > limit:
            yield current
            current, size = [], 0
        current.append((name, t))
        open_[t.dtype] = (current, size + n)
    for current, _ in open_.values():
        if current:
            yield current


def dtype_name(dtype: torch.dtype) -> str:
    """The string SGLang resolves with getattr(torch, name): torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def flatten_bucket(tensors: Sequence[torch.Tensor],
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensors' bytes end to end, as one uint8 tensor: a new buffer, or the first bytes of
    `out` (uint8, large enough; a buffer reused across buckets). One copy of each tensor
    (torch.cat writes straight into the result); tensors already laid end to end in one
    storage (`consecutive_region`) are returned as a view of it, without any copy."""
    region = consecutive_region(tensors)
    if region is not None:
        return region
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if out is None:
        return torch.cat(parts)
    return torch.cat(parts, out=out[:sum(p.numel() for p in parts)])


class FlatBuffer:
    """A uint8 buffer that buckets are flattened into, kept across buckets and syncs and grown
    to the largest: a fresh buffer of a large bucket costs its page faults on every sync on
    CPU (measured in docs/benchmarks.md). A bucket laid end to end already is not copied."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """flatten_bucket(tensors) in this buffer: valid until the next call."""
        if (region := consecutive_region(tensors)) is not None:
            return region
        nbytes = sum(tensor_nbytes(t) for t in tensors)
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # freed before the larger one is allocated
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
        return flatten_bucket(tensors, out=self._buffer)


def consecutive_region(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A uint8 view of exactly the bytes of `tensors` when they lie end to end, in this order,
    in one storage (each contiguous, same device); None otherwise. Such a view is the
    flattened bucket of those tensors, and writing into it writes into them."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.device != first.device or t.data_ptr() != end
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        end += tensor_nbytes(t)
    offset = first.data_ptr() - storage.data_ptr()
    region = torch.empty(0, dtype=torch.uint8, device=first.device)
    return region.set_(storage, offset, (end - first.data_ptr(),))


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize


def flat_nbytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    """Size of the flattened bucket of these tensors."""
    return sum(_nbytes(d, s) for d, s in zip(dtypes, shapes))


def unflatten_bucket(flat: torch.Tensor, dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat` (uint8) as the tensors it holds; ValueError on a size mismatch."""
    if flat_nbytes(dtypes, shapes) != flat.numel():
        raise ValueError(f"a flattened bucket of {flat.numel()} bytes, announced tensors of "
                         f"{flat_nbytes(dtypes, shapes)} bytes")
    out, start = [], 0
    for dtype, shape in zip(dtypes, shapes):
        n = _nbytes(dtype, shape)
        part = flat[start:start + n]
        if start % dtype.itemsize:
            part = part.clone()  # a view as `dtype` needs an offset aligned to its size
        out.append(part.view(dtype).reshape(list(shape)))
        start += n
    return out
