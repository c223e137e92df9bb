"""Context parallelism (`trainer.context_parallel_size`): each sequence split over CP ranks.

megatron-core runs CP only inside transformer-engine's attention (`TEDotProductAttention`, which
exchanges keys and values around the CP ring); its own `DotProductAttention` asserts
`context_parallel_size == 1` ("Context parallelism is only supported by TEDotProductAttention!",
megatron/core/transformer/dot_product_attention.py in megatron-core 0.16). transformer-engine
needs CUDA. So CP > 1 runs only where CUDA and transformer_engine are present, and is refused
elsewhere with that reason (`refusal`, checked when the trainer starts: the launcher's machine
is not the trainer's).

The data path (GPU only; not exercised by CI): a micro-batch's sequence is right-padded to a
multiple of 2 x CP and cut into 2 x CP chunks; CP rank r keeps chunks r and 2CP-1-r (causal
attention's work is balanced, as in Megatron-LM). After the model, the vocab logits of every
rank's chunks are all-gathered back into the whole sequence, so the loss is the same function
as without CP; the gradient of each rank's chunk goes back through its own slice.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
from torch import Tensor


def refusal(cp_size: int, *, cuda: bool, te: bool) -> str | None:
    """Why this machine cannot run context_parallel_size=cp_size, or None if it can."""
    if cp_size == 1:
        return None
    if not cuda:
        return (f"trainer.context_parallel_size={cp_size} needs GPUs: megatron-core splits "
                "sequences only inside transformer-engine's attention (its local "
                "DotProductAttention asserts context_parallel_size == 1), and transformer-engine "
                "needs CUDA; on CPU use trainer.context_parallel_size=1")
    if not te:
        return (f"trainer.context_parallel_size={cp_size} needs transformer-engine "
                "(megatron-core's context parallelism is in TEDotProductAttention only): install "
                "it (pip install -e \".[gpu]\", see docs/backends.md) or use "
                "trainer.context_parallel_size=1")
    return None


def machine_support() -> tuple[bool, bool]:
    """(CUDA present, a real transformer_engine importable) on this process's machine."""
    cuda = torch.cuda.is_available()
    te = False
    try:
        spec = importlib.util.find_spec("transformer_engine")
        # the CPU layer registers a stub module (cpu_compat), which is not transformer-engine
        te = spec is not None and spec.origin is not None and "cpu stub" not in str(spec.origin)
    except (ImportError, ValueError):
        te = False
    return cuda, te


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """The sequence positions CP rank `cp_rank` holds: chunks r and 2CP-1-r of 2CP equal ones.
    seq_len must divide by 2 x cp_size (`padded_length`)."""
    n = 2 * cp_size
    assert seq_len % n == 0, (seq_len, cp_size)
    size = seq_len // n
    first, second = cp_rank, n - 1 - cp_rank
    return torch.cat([torch.arange(first * size, (first + 1) * size),
                      torch.arange(second * size, (second + 1) * size)])


def padded_length(seq_len: int, cp_size: int, sp_size: int = 1) -> int:
    """seq_len rounded up to a multiple of 2 x CP x `sp_size`: 2 x CP chunks, and with sequence
    parallelism (`sp_size` = TP) each CP rank's T/CP tokens split again over the TP ranks
    (megatron-core asserts it divides; 2 x CP alone failed at TP=2 for odd chunk lengths)."""
    n = 2 * cp_size * sp_size
    return -(-seq_len // n) * n


def local_tokens(input_ids: Tensor, cp_size: int, cp_rank: int, sp_size: int = 1
                 ) -> tuple[Tensor, Tensor]:
    """This rank's tokens [B, T_pad/CP] and their positions [T_pad/CP]; right-padding (token 0)
    comes after every real token, so causal attention never lets it change them. `sp_size`:
    the TP size under sequence parallelism, else 1 (`padded_length`)."""
    B, T = input_ids.shape
    padded = padded_length(T, cp_size, sp_size)
    if padded != T:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(B, padded - T)], dim=1)
    pos = chunk_positions(padded, cp_size, cp_rank).to(input_ids.device)
    return input_ids.index_select(1, pos), pos


def reassemble(parts: list[Tensor], cp_size: int) -> Tensor:
    """Every CP rank's local chunks ([B, T_pad/CP, ...] each, in rank order) -> [B, T_pad, ...]."""
    size = parts[0].shape[1] // 2
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp_size - 1 - r] = part[:, :size], part[:, size:]
    return torch.cat(chunks, dim=1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, group, cp_size: int, cp_rank: int) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.cp = (cp_size, cp_rank)
        return reassemble(parts, cp_size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp_size, cp_rank = ctx.cp
        pos = chunk_positions(grad.shape[1], cp_size, cp_rank).to(grad.device)
        # every CP rank computes the whole loss; each one's tokens take their own gradient
        return grad.index_select(1, pos), None, None, None


def gather_sequence(local: Tensor, seq_len: int) -> Tensor:
    """Local logits [B, T_pad/CP, V] of every CP rank -> the whole sequence's [B, seq_len, V]."""
    from megatron.core import parallel_state as ps

    cp_size = ps.get_context_parallel_world_size()
    whole = _GatherSequence.apply(local, ps.get_context_parallel_group(), cp_size,
                                  ps.get_context_parallel_rank())
    return whole[:, :seq_len]
