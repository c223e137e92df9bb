"""How the megatron torchrun scripts here read one step's gradients: for a `with` block the
optimizer step copies each parameter's main_grad (what Megatron DDP accumulated, reduced over
the data-parallel group) into the parameter itself, so that the bridge's export, which reads
weights, returns the gradients under HF names (gathered over TP)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def grads_into_weights(mm, *, norm: bool = False):
    """Within the block, `mm.optimizer.step()` (`mm`: a MegatronModel, or anything with
    `optimizer` and DDP-wrapped `chunks`) writes every parameter's main_grad into it and
    updates nothing. With `norm`, the step first computes the grad norm megatron's clipping
    would see (its prepare_grads moves main_grad to where the norm reads it) and reports it,
    as a real step does; otherwise it reports 0. The real step is back after the block."""
    real_step = mm.optimizer.step

    def step():
        grad_norm = 0.0
        if norm:
            mm.optimizer.prepare_grads()
            grad_norm = mm.optimizer.get_grad_norm()
        with torch.no_grad():
            for c in mm.chunks:
                for p in c.module.parameters():
                    p.copy_(p.main_grad)
        return True, grad_norm, 0

    mm.optimizer.step = step
    try:
        yield
    finally:
        mm.optimizer.step = real_step
