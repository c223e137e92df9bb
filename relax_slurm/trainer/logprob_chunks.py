"""Per-position terms (log-probs, entropy) computed over chunks of the sequence
(`trainer.logprob_chunk_size`).

From the model's logits [B, T, V] (each TP rank's [B, T, V/TP] under megatron) the step builds
float32 tensors of the same size: the scaled copy, the exponentials or softmax of the entropy,
and autograd keeps some of them for the backward. For long rows of a large vocabulary these
are the step's largest tensors (Qwen3's 151,936 tokens x 8,192 positions: 5 GB each). Cut into
chunks of positions, each chunk's terms are computed from its slice of the logits under
activation checkpointing (non-reentrant): the forward keeps only the slice (a view of the
logits, which exist anyway) and the backward recomputes the chunk's float32 tensors when it
reaches them, one chunk at a time. Every term is per position (reductions run over the
vocabulary only), so the values are those of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Terms = tuple[Tensor | None, ...]


def over_positions(fn: Callable[..., Terms], chunk: int, *tensors: Tensor) -> Terms:
    """`fn(*tensors)`, its outputs [B, T] (or None), computed over chunks of `chunk` positions
    (dim 1 of every input) and concatenated; `chunk` 0 or at least T: one call, as it is.
    With autograd on, each chunk runs under checkpointing (above). `fn` may hold collectives
    (megatron's TP reductions): every rank then runs the same chunks, and the same
    recomputations in its backward."""
    T = tensors[0].shape[1]
    if chunk <= 0 or chunk >= T:
        return fn(*tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = []
    # split, not slices: its backward concatenates the chunks' gradients once, where each
    # slice's would fill a zero tensor of the whole size and add it
    for pieces in zip(*(t.split(chunk, dim=1) for t in tensors)):
        parts.append(checkpoint(fn, *pieces, use_reentrant=False) if grad else fn(*pieces))
    return tuple(None if outs[0] is None else torch.cat(outs, dim=1) for outs in zip(*parts))
