"""torchrun --nproc-per-node 2 megatron_pad_embedding.py --out DIR

relax_slurm/trainer/megatron/pad_embedding.py against HF's `nn.Embedding(padding_idx=...)` at
TP=2: a megatron-core VocabParallelEmbedding alone, its output all-reduced (no sequence
parallelism) or transposed and reduce-scattered to [S/TP, B, H] (sequence parallelism, as
LanguageModelEmbedding builds it), with the pad id in TP rank 0's vocabulary shard and in rank
1's. The loss is a fixed linear function of the embedding's output plus one of its weight read
directly (a tied LM head's use of the same parameter, whose gradient for the pad row must
stay). Rank 0 writes DIR/result.json, per case: the output's and the weight gradient's largest
gap to the torch reference (over both shards), the gradient's scale, and the pad row's gradient
without the fix's gap to the reference (non-zero: the case tests something).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from script_result import each_layout, finish

from relax_slurm.trainer.megatron import cpu_compat
from relax_slurm.trainer.megatron.pad_embedding import skip_padding_embedding_grads

V, H, B, S = 16, 8, 3, 6  # S divisible by TP=2, as sequence parallelism requires


def fixed_inputs(pad: int) -> dict[str, torch.Tensor]:
    """The same weight, ids (the pad id among them), output and weight coefficients on every
    rank."""
    g = torch.Generator().manual_seed(pad)
    ids = torch.randint(0, V, (B, S), generator=g)
    ids[0, 1] = ids[1, 4] = ids[2, 0] = pad
    return {"weight": torch.randn(V, H, generator=g), "ids": ids,
            "out_coef": torch.randn(B, S, H, generator=g),
            "weight_coef": torch.randn(V, H, generator=g)}


def reference_grad(x: dict[str, torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's embedding: (its output [B, S, H], the weight's gradient [V, H])."""
    emb = torch.nn.Embedding(V, H, padding_idx=pad)
    with torch.no_grad():
        emb.weight.copy_(x["weight"])
    out = emb(x["ids"])
    ((out * x["out_coef"]).sum() + (emb.weight * x["weight_coef"]).sum()).backward()
    return out.detach(), emb.weight.grad


def megatron_grad(x: dict[str, torch.Tensor], pad: int | None, sp: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's VocabParallelEmbedding (with the fix unless `pad` is None): (its output in
    the [B, S, H] layout, gathered over TP under sequence parallelism; its shard's gradient)."""
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp,
                                 use_cpu_initialization=True, perform_initialization=False)
    emb = VocabParallelEmbedding(V, H, init_method=torch.nn.init.zeros_,
                                 reduce_scatter_embeddings=sp, config=config)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        emb.weight.copy_(x["weight"].chunk(2)[rank])
    skip_padding_embedding_grads([emb], pad)
    out = emb(x["ids"])
    coef = x["out_coef"]
    if sp:  # megatron's split: dim 0 of [S, B, H] in contiguous chunks, TP-rank order
        coef = coef.transpose(0, 1).chunk(2)[rank]
    ((out * coef).sum() + (emb.weight * x["weight_coef"].chunk(2)[rank]).sum()).backward()
    assert isinstance(emb.weight, torch.nn.Parameter)  # the forward's view is gone
    if sp:
        out = gather_from_sequence_parallel_region(out.detach()).transpose(0, 1)
    return out.detach(), emb.weight.grad


def run_case(pad: int, sp: bool) -> dict:
    x = fixed_inputs(pad)
    want_out, want_grad = reference_grad(x, pad)
    rank = dist.get_rank()
    want = want_grad.chunk(2)[rank]
    out, grad = megatron_grad(x, pad, sp)
    _, unfixed = megatron_grad(x, None, sp)
    gaps = torch.tensor([(out - want_out).abs().max(), (grad - want).abs().max(),
                         (unfixed - want).abs().max()])
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    return {"out_gap": gaps[0].item(), "grad_gap": gaps[1].item(),
            "grad_scale": want_grad.abs().max().item(), "unfixed_gap": gaps[2].item()}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cpu_compat.activate(0)  # megatron's reduce-scatter and all-gather on gloo
    result = {f"pad{pad}_{'sp' if sp else 'tp'}": run_case(pad, sp)
              for pad in (0, 11) for sp in (False, True)}  # 11: in rank 1's rows [8, 16)
    finish(args.out, result)


if __name__ == "__main__":
    each_layout(main)
