"""Log-probs and entropy from vocab-parallel logits, without the whole vocabulary on any rank.

Megatron's output layer leaves each tensor-parallel rank the logits of its slice of the
vocabulary, [B, T, V/TP]. Gathering them (what the step did until issue #34) built float32
logits over the whole vocabulary, and their softmax, on every TP rank: for Qwen3's 151,936
tokens one 8,192-token row is 5 GB, twice over with the softmax, whatever TP is. Here each rank
keeps its slice: the softmax's normaliser, the target's logit and the entropy's sum are
reduced over the TP group ([B, T] all-reduces, as megatron-core's
`vocab_parallel_cross_entropy` does for the loss), so the largest tensor is [B, T, V/TP].

Gradients: each reduction is megatron-core's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward); every TP rank computes the same loss from the reduced
values, so each rank's backward gives its own slice of the logits' gradient, as the split
backward of the gather did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def scaled_shard(output: Tensor, vocab_start: int, vocab_size: int, temperature: float,
                 banned_ids: list[int]) -> Tensor:
    """This rank's logits [..., V/TP] as float32 (or float64) / temperature; columns past the vocabulary
    (an output layer padded wider than the tokenizer's vocabulary) and `banned_ids` (media pad
    tokens, which the engine never samples) get the lowest finite logit, as in the full-vocabulary
    path (trainer/step.py scaled_logits)."""
    scaled = (output if output.dtype == torch.float64 else output.float()) / temperature
    width = scaled.shape[-1]
    low = torch.finfo(scaled.dtype).min
    if vocab_start + width > vocab_size:
        scaled[..., max(vocab_size - vocab_start, 0):] = low
    local = [i - vocab_start for i in banned_ids if vocab_start <= i < vocab_start + width]
    if local:
        scaled[..., local] = low
    return scaled


def logprobs_and_entropy(shard: Tensor, targets: Tensor, vocab_start: int,
                         group: dist.ProcessGroup | None, entropy: str | None = "metric"
                         ) -> tuple[Tensor, Tensor | None]:
    """log p(target) and the entropy of each position, [B, T], from this rank's scaled logits
    [B, T, V/TP] of the vocabulary slice starting at `vocab_start`. `group`: the TP group (None
    or one rank: the shard is the whole vocabulary). `entropy`: "grad" (an entropy bonus
    differentiates it), "metric" (no gradient) or None (not computed)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def total(x: Tensor) -> Tensor:
        if group is None or dist.get_world_size(group) == 1:
            return x
        return reduce_from_tensor_model_parallel_region(x, group)

    with torch.no_grad():  # the max only steadies exp(); it cancels out of every value
        top = shard.max(dim=-1).values
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = shard - top.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = total(exp.sum(dim=-1))
    log_z = sum_exp.log()
    width = shard.shape[-1]
    local = targets - vocab_start
    here = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    logp = total(picked * here) - log_z
    if entropy is None:
        return logp, None
    # H = log Z - sum_v p_v l_v, with l the shifted logits (the shift cancels). A masked
    # column (the lowest finite logit) has p = 0 exactly; its l is taken as 0, or its gradient
    # g * l overflows to -inf, and -inf * p = NaN
    with torch.enable_grad() if entropy == "grad" else torch.no_grad():
        weighted = exp * torch.where(exp > 0, shifted, 0.0)
        return logp, log_z - total(weighted.sum(dim=-1)) / sum_exp
