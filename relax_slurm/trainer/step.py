"""One optimizer step on this rank's block of the batch: log-probs, the algorithm's loss, backward, clip, step.

Per micro-batch the policy forward gives the log-probs of the sampled tokens and, from the same
logits, the per-token entropy (with gradient only when `algo.entropy_coef > 0`); a frozen
reference model adds `ref_logprobs` when `algo.kl_loss_coef > 0`; teacher log-probs come with
the samples (on-policy distillation). Everything goes to `algos.policy_loss`, whose metric sums
are added over micro-batches and ranks and divided by the number of trained tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relax_slurm.algos import policy_loss
from relax_slurm.config.schema import AlgoConfig
from relax_slurm.modeling import media_token_ids, mm_token_types
from relax_slurm.routing.hooks import RoutingStats, routing_replay
from relax_slurm.trainer.batch import MicroBatch, loss_params

# policy_loss metric sums logged under another name (all are divided by the trained tokens)
_LOG_NAMES = {"clipped_tokens": "clipfrac", "tis_masked_tokens": "tis_masked_frac",
              "opsm_masked_tokens": "opsm_masked_frac",
              "logprob_abs_diff": "rollout_train_logprob_diff"}


def scaled_logits(model: nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """Logits predicting each next token, divided by the engine's temperature, [B, T-1, V].
    A multimodal model's media pad tokens get the lowest logit, as the engine never samples
    them (the finite minimum keeps the entropy's softmax x logits free of NaN)."""
    media = mb.media.kwargs() if mb.media is not None else {}
    logits = model(**mb.forward_kwargs(), **mm_token_types(model, mb.input_ids, media)).logits
    scaled = logits[:, :-1].float() / temperature
    banned = list(media_token_ids(getattr(model, "module", model).config))
    if banned:
        scaled[..., banned] = torch.finfo(scaled.dtype).min
    return scaled


def gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) at every position, [B, T-1]."""
    # gather - logsumexp: avoids materialising the full log_softmax over the vocabulary
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each position's distribution, [B, T-1]: logsumexp(l) - sum(softmax(l) * l)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def token_logprobs(model: nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """log p(target) at every position, [B, T-1], under the same temperature the engine used."""
    return gather_logprobs(scaled_logits(model, mb, temperature), mb.targets)


@torch.no_grad()
def reference_logprobs(ref_model: nn.Module | None, mb: MicroBatch, temperature: float
                       ) -> Tensor | None:
    """The frozen reference model's log-probs of the same tokens, [B, T-1], or None."""
    return None if ref_model is None else token_logprobs(ref_model, mb, temperature)


def micro_batch_loss(logits: Tensor, mb: MicroBatch, algo: AlgoConfig, params: dict,
                     ref_logp: Tensor | None) -> tuple[Tensor, dict]:
    """The algorithm's loss (a weighted sum: summed over micro-batches and ranks it is the
    batch's loss) and its metric sums, from the temperature-scaled logits [B, T-1, V]. Shared
    by every trainer backend."""
    logp = gather_logprobs(logits, mb.targets)
    # the bonus needs the entropy's gradient; otherwise it is only logged
    entropy = token_entropy(logits if algo.entropy_coef else logits.detach())
    # one optimizer step per batch: the "old" policy is the current one, so ratio = 1 in
    # value and the PPO clip only shapes the gradient; detaching avoids a second forward.
    # old_logprobs=rollout measures the ratio against the sampling engine instead
    old = mb.rollout_logp if algo.old_logprobs == "rollout" else logp.detach()
    return policy_loss(
        algo.name, logp, old, mb.advantages, mb.weights, mb.rollout_logp,
        reduction="weighted_sum", entropy=entropy, ref_logprobs=ref_logp,
        teacher_logprobs=mb.teacher_logp, **params,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    blocks: Iterable[tuple[MicroBatch, bool]],
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    grad_clip: float,
    temperature: float,
    ref_model: nn.Module | None = None,
    before_update: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """`blocks`: this rank's rows of the step's batch, one block or several as groups arrive
    (trainer/stream.py), the last one flagged; gradients accumulate over all of them.
    `before_update` runs just before the optimizer changes the weights (an overlapped weight
    push of the previous version must be done reading them)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size()
    params = loss_params(algo)
    sums: dict[str, float] = {"loss": 0.0}
    routing = None
    for block, last_block in blocks:
        starts = range(0, len(block), micro_batch_size)
        if block.routed is not None and routing is None:
            routing = RoutingStats()
        for i, lo in enumerate(starts):
            mb = block.rows(lo, lo + micro_batch_size)
            last = last_block and i == len(starts) - 1
            # DDP: all-reduce gradients once, on the step's last micro-batch
            sync = (contextlib.nullcontext() if last or not hasattr(model, "no_sync")
                    else model.no_sync())
            # MoE samples with the rollout's routing: compare with this router's, replay if asked
            replay = (routing_replay(model, mb.routed, mb.routed_valid(),
                                     replay=algo.routing_replay, stats=routing)
                      if mb.routed is not None else contextlib.nullcontext())
            with sync:
                with replay:
                    logits = scaled_logits(model, mb, temperature)  # [B, T-1, V]
                loss, metrics = micro_batch_loss(logits, mb, algo, params,
                                                 reference_logprobs(ref_model, mb, temperature))
                # weights sum to 1 over the whole batch across ranks; DDP averages over ranks
                (loss * world).backward()
            sums["loss"] += loss.item()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    if routing is not None:  # same keys on every rank: every rank's block carries routing
        sums["routing_pairs"] = routing.pairs
        sums["routing_mismatched"] = routing.mismatched
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    before_update()
    optimizer.step()
    scheduler.step()
    return {**reduce_metrics(sums), "train/grad_norm": float(grad_norm),
            "train/lr": scheduler.get_last_lr()[0]}


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Add every rank's sums (same keys everywhere: they depend on the config only) and divide
    each by the trained tokens: train/loss, train/tokens, train/clipfrac, train/entropy, ..."""
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(totals)
    total = dict(zip(keys, totals.tolist()))
    tokens = max(total.get("tokens", 0.0), 1.0)
    out = {"train/loss": total.pop("loss"), "train/tokens": total.pop("tokens", 0.0)}
    if "routing_pairs" in total:  # token x MoE-layer pairs, not trained tokens
        pairs, mismatched = total.pop("routing_pairs"), total.pop("routing_mismatched")
        out["train/routing_mismatch_frac"] = mismatched / max(pairs, 1.0)
    for key, value in total.items():
        out[f"train/{_LOG_NAMES.get(key, key)}"] = value / tokens
    return out
