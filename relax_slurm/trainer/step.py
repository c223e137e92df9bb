"""One optimizer step on this rank's shard: log-probs, GRPO loss, backward, clip, step."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relax_slurm.algos import policy_loss
from relax_slurm.config.schema import AlgoConfig
from relax_slurm.trainer.batch import MicroBatch, TrainItem, algo_params, collate


def token_logprobs(model: nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """log p(target) at every position, [B, T-1], under the same temperature the engine used."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    # gather - logsumexp: avoids materialising the full log_softmax over the vocabulary
    picked = logits.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    items: list[TrainItem],
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    grad_clip: float,
    temperature: float,
    pad_id: int,
    device: torch.device,
) -> dict[str, float]:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size()
    chunks = [items[i:i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
    params = algo_params(algo)
    params.pop("loss_reduction")  # folded into the per-token weights over the whole batch
    totals = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, |logp diff|, tokens
    for i, chunk in enumerate(chunks):
        mb = collate(chunk, pad_id, device)
        last = i == len(chunks) - 1
        # DDP: all-reduce gradients once, on the last micro-batch
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            logp = token_logprobs(model, mb, temperature)
            # one optimizer step per batch: the "old" policy is the current one, so ratio = 1 in
            # value and the PPO clip only shapes the gradient; detaching avoids a second forward
            loss, sums = policy_loss(
                algo.name, logp, logp.detach(), mb.advantages, mb.weights, mb.rollout_logp,
                reduction="weighted_sum", **params,
            )
            # weights sum to 1 over the whole batch across ranks; DDP averages over ranks
            (loss * world).backward()
        totals += torch.tensor([loss.item(), sums["clipped_tokens"].item(),
                                sums["logprob_abs_diff"].item(), sums["tokens"].item()],
                               dtype=torch.float64)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    dist.all_reduce(totals)
    tokens = max(totals[3].item(), 1.0)
    return {
        "train/loss": totals[0].item(),
        "train/grad_norm": float(grad_norm),
        "train/clipfrac": totals[1].item() / tokens,
        "train/rollout_train_logprob_diff": totals[2].item() / tokens,
        "train/lr": scheduler.get_last_lr()[0],
    }
