"""One optimizer step on this rank's block of the batch: log-probs, the algorithm's loss,
backward, clip, step.

Per micro-batch the policy forward gives the log-probs of the sampled tokens and, from the same
logits, the per-token entropy (with gradient only when `algo.entropy_coef > 0`); a frozen
reference model adds `ref_logprobs` when `algo.kl_loss_coef > 0` or `algo.kl_coef > 0`;
teacher log-probs come with the samples (on-policy distillation, any estimator). With
`trainer.num_steps_per_rollout > 1` the rows are cut into mini-batches, one optimizer step each,
after one forward without gradient for the old log-probs. Everything goes to
`algos.policy_loss`, whose metric sums are added over micro-batches and ranks and divided by the
number of trained tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relax_slurm.algos import policy_loss
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.algo_params import EstimatorParams
from relax_slurm.modeling import media_token_ids, mm_token_types
from relax_slurm.routing.hooks import RoutingStats, routing_replay
from relax_slurm.trainer import collectives
from relax_slurm.trainer.batch import MicroBatch, loss_params

# policy_loss metric sums logged under another name (all are divided by the trained tokens)
_LOG_NAMES = {"clipped_tokens": "clipfrac", "tis_masked_tokens": "tis_masked_frac",
              "opsm_masked_tokens": "opsm_masked_frac",
              "logprob_abs_diff": "rollout_train_logprob_diff"}


def scaled_logits(model: nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """Logits predicting each next token, divided by the engine's temperature, [B, T-1, V],
    float32."""
    return scale_logits(next_token_logits(model, mb), temperature, banned_ids(model))


def next_token_logits(model: nn.Module, mb: MicroBatch) -> Tensor:
    """The model's logits predicting each next token, [B, T-1, V], in its dtype."""
    media = mb.media.kwargs() if mb.media is not None else {}
    logits = model(**mb.forward_kwargs(), **mm_token_types(model, mb.input_ids, media)).logits
    return logits[:, :-1]


def banned_ids(model: nn.Module) -> list[int]:
    """A multimodal model's media pad tokens, which the engine never samples."""
    return list(media_token_ids(getattr(model, "module", model).config))


def scale_logits(logits: Tensor, temperature: float, banned: list[int]) -> Tensor:
    """float32 logits / the engine's temperature; `banned` tokens get the lowest logit (the
    finite minimum keeps the entropy's softmax x logits free of NaN)."""
    scaled = logits.float() / temperature
    if banned:
        scaled[..., banned] = torch.finfo(scaled.dtype).min
    return scaled


def token_terms(logits: Tensor, targets: Tensor, temperature: float, banned: list[int],
                entropy: str | None, chunk: int = 0) -> tuple[Tensor, Tensor | None]:
    """log p(target) and the entropy at each position, [B, T-1], from the model's logits
    [B, T-1, V] (next_token_logits), over chunks of `chunk` positions (trainer.
    logprob_chunk_size: trainer/logprob_chunks.py). `entropy`: "grad" (an entropy bonus
    differentiates it), "metric" (no gradient) or None (not computed)."""
    from relax_slurm.trainer.logprob_chunks import over_positions

    def terms(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        scaled = scale_logits(logits, temperature, banned)
        logp = gather_logprobs(scaled, targets)
        if entropy is None:
            return logp, None
        return logp, token_entropy(scaled if entropy == "grad" else scaled.detach())

    return over_positions(terms, chunk, logits, targets)


def gather_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) at every position, [B, T-1]."""
    # gather - logsumexp: avoids materialising the full log_softmax over the vocabulary
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each position's distribution, [B, T-1]: logsumexp(l) - sum(softmax(l) * l)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def token_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, chunk: int = 0
                   ) -> Tensor:
    """log p(target) at every position, [B, T-1], under the same temperature the engine used,
    over chunks of `chunk` positions (trainer.logprob_chunk_size; 0: at once)."""
    return token_terms(next_token_logits(model, mb), mb.targets, temperature, banned_ids(model),
                       None, chunk)[0]


@torch.no_grad()
def reference_logprobs(ref_model: nn.Module | None, mb: MicroBatch, temperature: float,
                       chunk: int = 0) -> Tensor | None:
    """The frozen reference model's log-probs of the same tokens, [B, T-1], or None: the
    micro-batch's own (`mb.ref_logp`, computed for the whole batch by a sharded reference)
    when it carries them, else a forward of `ref_model` (over chunks of `chunk` positions)."""
    if mb.ref_logp is not None:
        return mb.ref_logp
    return None if ref_model is None else token_logprobs(ref_model, mb, temperature, chunk)


def token_loss(logp: Tensor, entropy: Tensor, mb: MicroBatch, algo: AlgoConfig,
               loss_kwargs: dict, ref_logp: Tensor | None) -> tuple[Tensor, dict]:
    """The algorithm's loss (a weighted sum: summed over micro-batches and ranks it is the
    batch's loss) and its metric sums, from the positions' log-probs and entropies [B, T-1]
    (token_terms; a backend that never holds the whole vocabulary's logits computes them
    itself: megatron/vocab_parallel.py). Shared by every trainer backend. `loss_kwargs`:
    `batch.loss_params(algo, ...)`, built per step. The entropy carries a gradient only with
    an entropy bonus (algo.entropy_coef)."""
    # one optimizer step per batch: the "old" policy is the current one, so ratio = 1 in
    # value and the PPO clip only shapes the gradient; detaching avoids a second forward.
    # Several steps per batch (mb.old_logp): the policy before the first of them.
    # old_logprobs=rollout measures the ratio against the sampling engine instead
    if algo.old_logprobs == "rollout":
        old = mb.rollout_logp
    else:
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
    return policy_loss(
        algo.name, logp, old, mb.advantages, mb.weights, mb.rollout_logp,
        reduction="weighted_sum", entropy=entropy, ref_logprobs=ref_logp,
        teacher_logprobs=mb.teacher_logp, **loss_kwargs,
    )


@torch.no_grad()
def nll_sums(model: torch.nn.Module, block: MicroBatch, micro_batch_size: int, chunk: int = 0
             ) -> dict[str, float]:
    """Forward only: this rank's summed NLL over its rows' trained tokens and their count.
    Every rank calls it with as many micro-batches (FSDP2 gathers weights per forward)."""
    model.eval()
    nll, tokens = 0.0, 0.0
    for lo in range(0, len(block), micro_batch_size):
        mb = block.rows(lo, lo + micro_batch_size)
        mask = (mb.weights != 0).float()  # [B, T-1]
        logp = token_logprobs(model, mb, 1.0, chunk)
        nll -= float((logp * mask).sum())
        tokens += float(mask.sum())
    model.train()
    return {"nll": nll, "tokens": tokens}


def _policy_logits(model: nn.Module, mb: MicroBatch, algo: AlgoConfig,
                   routing: RoutingStats | None) -> Tensor:
    """The policy's logits [B, T-1, V] (next_token_logits); MoE rows with the rollout's
    routing are compared with this router's (and replayed when asked)."""
    replay = (routing_replay(model, mb.routed, mb.routed_valid(), replay=algo.routing_replay,
                             stats=routing)
              if mb.routed is not None else contextlib.nullcontext())
    with replay:
        return next_token_logits(model, mb)


def _micro_batches(block: MicroBatch, size: int) -> list[MicroBatch]:
    return [block.rows(lo, lo + size) for lo in range(0, len(block), size)]


def _accumulate(model: nn.Module, blocks: Iterable[tuple[MicroBatch, bool]], algo: AlgoConfig,
                loss_kwargs: dict, sums: dict, *, micro_batch_size: int, temperature: float,
                ref_model: nn.Module | None, scale: float, routing: list, chunk: int) -> None:
    """Forward/backward over the blocks' micro-batches, gradients accumulating; metric sums
    added to `sums`. `scale`: the loss's factor in the backward (the data ranks, times the
    mini-batches a batch is cut into: each mini-batch's weights then sum to 1). `chunk`:
    trainer.logprob_chunk_size."""
    banned = banned_ids(model)
    # the bonus needs the entropy's gradient; otherwise it is only logged
    entropy = "grad" if algo.entropy_coef else "metric"
    for block, last_block in blocks:
        if block.routed is not None and not routing:
            routing.append(RoutingStats())
        mbs = _micro_batches(block, micro_batch_size)
        for i, mb in enumerate(mbs):
            last = last_block and i == len(mbs) - 1
            # DDP: all-reduce gradients once, on the step's last micro-batch
            sync = (contextlib.nullcontext() if last or not hasattr(model, "no_sync")
                    else model.no_sync())
            with sync:
                logits = _policy_logits(model, mb, algo,
                                        routing[0] if routing else None)  # [B, T-1, V]
                logp, ent = token_terms(logits, mb.targets, temperature, banned, entropy, chunk)
                loss, metrics = token_loss(logp, ent, mb, algo, loss_kwargs,
                                           reference_logprobs(ref_model, mb, temperature,
                                                              chunk))
                # weights sum to 1 over the whole batch across ranks; DDP averages over ranks
                (loss * scale).backward()
            # summed on the device, read once per step (reduce_metrics): a read per micro-batch
            # would wait for the GPU each time
            # (float64, as the host's float sums were)
            sums["loss"] = sums["loss"] + loss.detach().double()
            for key, value in metrics.items():
                value = value.detach().double() if isinstance(value, Tensor) else value
                sums[key] = sums.get(key, 0.0) + value


@torch.no_grad()
def with_old_logprobs(model: nn.Module, block: MicroBatch, algo: AlgoConfig, num_steps: int,
                      micro_batch_size: int, temperature: float, chunk: int = 0) -> MicroBatch:
    """The block with `old_logp` [rows, T-1]: the policy's log-probs before the first of the
    step's optimizer steps, computed mini-batch by mini-batch in the same micro-batches the
    update runs (so the first mini-batch's ratio is exactly 1, as with one step)."""
    old = torch.zeros_like(block.weights)
    for lo, mini in mini_batches(block, num_steps):
        for j, mb in enumerate(_micro_batches(mini, micro_batch_size)):
            logits = _policy_logits(model, mb, algo, RoutingStats())
            row = lo + j * micro_batch_size
            old[row:row + len(mb), :mb.targets.shape[1]] = token_terms(
                logits, mb.targets, temperature, banned_ids(model), None, chunk)[0]
    return dataclasses.replace(block, old_logp=old)


def mini_batches(block: MicroBatch, num_steps: int) -> list[tuple[int, MicroBatch]]:
    """This rank's rows cut into `num_steps` equal contiguous mini-batches (first row, rows):
    mini-batch k of the step is every data rank's k-th piece."""
    if len(block) % num_steps:
        raise ValueError(f"{len(block)} rows on this rank do not split into "
                         f"trainer.num_steps_per_rollout={num_steps} mini-batches")
    size = len(block) // num_steps
    return [(lo, block.rows(lo, lo + size)) for lo in range(0, len(block), size)]


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
    num_steps: int = 1,
    params: EstimatorParams | None = None,
    logprob_chunk_size: int = 0,
) -> dict[str, float]:
    """`blocks`: this rank's rows of the step's batch, one block or several as groups arrive
    (trainer/stream.py), the last one flagged; gradients accumulate over all of them.
    `before_update` runs just before the optimizer first changes the weights (an overlapped
    weight push of the previous version must be done reading them).

    `num_steps` > 1 (trainer.num_steps_per_rollout; whole batches only): the block is cut into
    that many mini-batches, one optimizer step each, the ratio's "old" log-probs computed once
    before the first. The lr schedule advances once per batch; the metrics are one row: sums
    over every mini-batch (`train/loss` the mean of the mini-batches' losses, `train/grad_norm`
    the mean of their norms). `params`: `algo.estimator_params()`, the backend's (built once
    per run; here without). `logprob_chunk_size`: trainer.logprob_chunk_size."""
    model.train()
    world = dist.get_world_size()
    loss_kwargs = loss_params(algo, params)
    sums: dict[str, float] = {"loss": 0.0}
    routing: list[RoutingStats] = []
    run = functools.partial(_accumulate, model, algo=algo, loss_kwargs=loss_kwargs, sums=sums,
                            micro_batch_size=micro_batch_size, temperature=temperature,
                            ref_model=ref_model, routing=routing, chunk=logprob_chunk_size)
    if num_steps == 1:
        optimizer.zero_grad(set_to_none=True)
        run(blocks, scale=world)
        norms = [_clip(model, grad_clip)]
        before_update()
        optimizer.step()
    else:
        [(block, _)] = list(blocks)
        if algo.old_logprobs == "recompute":
            block = with_old_logprobs(model, block, algo, num_steps, micro_batch_size,
                                      temperature, logprob_chunk_size)
        norms = []
        for k, (_, mini) in enumerate(mini_batches(block, num_steps)):
            optimizer.zero_grad(set_to_none=True)
            run([(mini, True)], scale=world * num_steps)
            norms.append(_clip(model, grad_clip))
            if k == 0:
                before_update()
            optimizer.step()
    scheduler.step()
    if routing:  # same keys on every rank: every rank's block carries routing
        sums["routing_pairs"] = routing[0].pairs
        sums["routing_mismatched"] = routing[0].mismatched
    return {**reduce_metrics(sums), "train/grad_norm": sum(norms) / len(norms),
            "train/lr": scheduler.get_last_lr()[0]}


def _clip(model: nn.Module, grad_clip: float) -> float:
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)


def reduce_metrics(sums: dict[str, float | Tensor]) -> dict[str, float]:
    """Add every rank's sums (same keys everywhere: they depend on the config only) and divide
    each by the trained tokens: train/loss, train/tokens, train/clipfrac, train/entropy, ..."""
    keys = sorted(sums)
    total = dict(zip(keys, collectives.all_reduce_sum([sums[k] for k in keys])))
    tokens = max(total.get("tokens", 0.0), 1.0)
    out = {"train/loss": total.pop("loss"), "train/tokens": total.pop("tokens", 0.0)}
    if "routing_pairs" in total:  # token x MoE-layer pairs, not trained tokens
        pairs, mismatched = total.pop("routing_pairs"), total.pop("routing_mismatched")
        out["train/routing_mismatch_frac"] = mismatched / max(pairs, 1.0)
    for key, value in total.items():
        out[f"train/{_LOG_NAMES.get(key, key)}"] = value / tokens
    return out
