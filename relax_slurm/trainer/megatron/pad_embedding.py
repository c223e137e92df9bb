"""HF's `nn.Embedding(padding_idx=pad_token_id)` for megatron-core's VocabParallelEmbedding,
which has no padding_idx: the lookup sends the pad token's row no gradient.

Why it matters: the pad token is also a token a policy can sample (the tiny model does, inside
its responses), and its embedding row is zero in HF checkpoints (padding_idx rows are
initialised so): an RMS norm of a zero vector has a gradient of ~1/sqrt(eps), so on the tiny
task's first batch that one row's gradient had norm 4.6 against 0.13 for the whole rest of the
model, and grad_clip=1 shrank every real gradient 37x (measured; the torch backend's gradients
were the rest exactly).

What padding_idx is, exactly: F.embedding's backward skips the positions holding padding_idx
when it scatters the output's gradient into the weight. Nothing else changes: the output's
gradient has nowhere else to go (the input is integer ids), and other uses of the same weight
(a tied LM head) keep their gradient for that row. So the fix acts on the lookup's use of the
weight alone, at the weight: the lookup reads the weight through an identity whose backward
zeroes the pad row of the gradient it passes on, and the tied output layer, which reads the
parameter itself, is untouched.

Why at the weight, not at the embedding's output: VocabParallelEmbedding all-reduces its
output over TP, or under sequence parallelism transposes and reduce-scatters it to
[S/TP, B, H] (megatron-core 0.16 tensor_parallel/layers.py, `reduce_scatter_embeddings`, set
by LanguageModelEmbedding); an output-side mask would have to know which output positions hold
pad ids in each layout. The weight's gradient is per shard row whatever the layout: TP rank r
holds rows [vocab_start_index, vocab_end_index) and its lookup maps ids outside them to local
row 0 with their output zeroed (so they add nothing to row 0's gradient); the pad row is
local row pad_id - vocab_start_index on the one rank whose range holds it. The gradient is
zeroed before it reaches the parameter's AccumulateGrad, so Megatron DDP's main_grad buffers,
the grad norm and clipping never see it.
"""

from __future__ import annotations

import torch


class _NoGradToRow(torch.autograd.Function):
    """The weight itself (a view) forward; backward, its gradient with row `row` zeroed."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, row: int) -> torch.Tensor:
        ctx.row = row
        ctx.set_materialize_grads(False)  # no gradient in (an unused lookup): none out
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None
        # in place: the lookup's backward made this tensor for this one input (a dense
        # [V/TP, H] gradient; a copy would double the embedding's peak gradient memory)
        grad[ctx.row] = 0
        return grad, None


def local_pad_row(pad_id: int, vocab_start: int, vocab_end: int) -> int | None:
    """The pad token's row in a TP shard holding vocabulary rows [vocab_start, vocab_end), or
    None when another shard holds it."""
    return pad_id - vocab_start if vocab_start <= pad_id < vocab_end else None


def skip_padding_embedding_grads(chunks: list, pad_id: int | None) -> None:
    """Every VocabParallelEmbedding in `chunks` sends its pad row no gradient from its lookup,
    as HF's padding_idx (module docstring): for the duration of each forward, the module's
    `weight` attribute is the masking view of its parameter (an instance attribute shadows
    nn.Module's parameter lookup; the parameter stays registered, so DDP, the optimizer and
    checkpoints see nothing different), and after it, even one that raised, the parameter."""
    if pad_id is None:
        return
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    def before(module, args):
        weight = module._parameters["weight"]
        row = local_pad_row(pad_id, module.vocab_start_index, module.vocab_end_index)
        if row is not None and weight.requires_grad and torch.is_grad_enabled():
            module.__dict__["weight"] = _NoGradToRow.apply(weight, row)

    def after(module, args, output):
        module.__dict__.pop("weight", None)

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.register_forward_pre_hook(before)
                module.register_forward_hook(after, always_call=True)
