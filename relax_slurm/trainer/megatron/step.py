"""One optimizer step of the megatron backend: Megatron's forward/backward schedule (pipelined
when pipeline_parallel_size > 1) over this data-parallel rank's micro-batches, the same loss as
the torch backend (`trainer.step.token_loss`), Megatron's optimizer step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.algo_params import EstimatorParams
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.batch import MicroBatch, loss_params
from relax_slurm.trainer.megatron import context_parallel
from relax_slurm.routing.hooks import RoutingStats
from relax_slurm.trainer.megatron.model import MegatronModel
from relax_slurm.trainer.megatron.routing import megatron_routing
from relax_slurm.trainer.megatron import vocab_parallel
from relax_slurm.trainer.logprob_chunks import over_positions
from relax_slurm.trainer.step import mini_batches, reduce_metrics, token_loss


def micro_batches(batch: MicroBatch, size: int, pipelined: bool) -> list[MicroBatch]:
    """Equal blocks of rows: the pipeline sends fixed-shape activations between stages."""
    if pipelined and len(batch) % min(size, len(batch)):
        raise ConfigError(
            f"{len(batch)} rows per data-parallel rank do not split into micro-batches of "
            f"trainer.micro_batch_size={size}, which pipeline parallelism needs; choose a "
            "micro_batch_size that divides the rows per rank")
    return [batch.rows(lo, lo + size) for lo in range(0, len(batch), size)]


def train_step(mm: MegatronModel, batch: MicroBatch, algo: AlgoConfig, *, micro_batch_size: int,
               temperature: float,
               before_update: Callable[[], None] = lambda: None,
               num_steps: int = 1, params: EstimatorParams | None = None) -> dict[str, float]:
    """One rollout batch: `num_steps` optimizer steps (trainer.num_steps_per_rollout), one per
    contiguous mini-batch of this rank's rows, as the torch backend's `trainer.step.train_step`:
    the ratio's "old" log-probs computed once before the first (forward only, in the same
    micro-batches), the lr set once per batch, the metrics one row (sums over the mini-batches,
    `train/grad_norm` their mean). `params`: `algo.estimator_params()`, the backend's (built
    once per run; here without)."""
    from megatron.core import parallel_state as ps

    mm.train()
    lr = mm.set_lr()
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    if num_steps > 1 and algo.old_logprobs == "recompute":
        batch = with_old_logprobs(mm, batch, algo, num_steps, micro_batch_size, temperature)
    cp_rank = ps.get_context_parallel_rank()
    # MoE samples with the rollout's routing: every stage's routers compare, and replay when
    # asked. Each rank counts the tokens its routers see: under sequence (context) parallelism
    # every TP (CP) rank its own slice of the sequence; without it TP peers route the same
    # tokens and rank 0 counts. reduce_metrics sums over all ranks: the whole batch's figure
    counts = mm.sequence_parallel or ps.get_tensor_model_parallel_rank() == 0
    routing = RoutingStats() if batch.routed is not None and counts else None
    sums: dict[str, float | torch.Tensor] = {"loss": 0.0}
    norms, skipped = [], 0.0
    for k, (_, mini) in enumerate(mini_batches(batch, num_steps)):
        for chunk in mm.chunks:
            chunk.zero_grad_buffer()
        mm.optimizer.zero_grad()
        mbs = micro_batches(mini, micro_batch_size, pipelined)
        # each mini-batch's weights sum to 1 / num_steps of the batch's: x num_steps makes it
        # a whole step's loss
        _forward_backward(mm, mbs, algo, temperature, routing, sums,
                          scale=num_steps, width=batch.input_ids.shape[1],
                          loss_kwargs=loss_params(algo, params))
        if k == 0:
            before_update()  # an overlapped push of the previous weights is done reading them
        ok, grad_norm, _ = mm.optimizer.step()
        norms.append(float(grad_norm or 0.0))
        skipped += float(not ok)
    mm.steps_done += 1
    if routing is not None:
        sums["routing_pairs"], sums["routing_mismatched"] = routing.pairs, routing.mismatched
    sums = _same_keys(sums)
    return {**reduce_metrics(sums), "train/grad_norm": sum(norms) / len(norms),
            "train/lr": lr, "train/update_skipped": skipped}


def _forward_backward(mm: MegatronModel, mbs: list[MicroBatch], algo: AlgoConfig,
                      temperature: float, routing: RoutingStats | None,
                      sums: dict[str, float | torch.Tensor], *, scale: int, width: int,
                      loss_kwargs: dict) -> None:
    """Megatron's schedule over the micro-batches, gradients accumulating; the metric sums of
    one rank per data-parallel block (last stage, TP rank 0, CP rank 0) added to `sums`."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n, dp = len(mbs), ps.get_data_parallel_world_size()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    # (CP ranks each compute the whole loss from the gathered logits: one counts)
    counted = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
               and cp_rank == 0)

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        output = _forward(mm, chunk, mb, cp, cp_rank, algo=algo, routing=routing)

        def loss_func(out):
            # the bonus needs the entropy's gradient; otherwise it is only logged
            logp, entropy = _token_terms(mm, out, width, cp, temperature, mb,
                                         "grad" if algo.entropy_coef else "metric")
            loss, metrics = token_loss(logp, entropy, mb, algo, loss_kwargs,
                                       mb.ref_logp)
            if counted:  # summed on the device, read once per step (reduce_metrics): a
                # read per micro-batch would wait for the GPU each time (float64, as before)
                sums["loss"] = sums["loss"] + loss.detach().double()
                for key, value in metrics.items():
                    value = value.detach().double() if isinstance(value, torch.Tensor) else value
                    sums[key] = sums.get(key, 0.0) + value
            # the schedule divides by the micro-batch count (and multiplies by CP), DDP averages
            # over data-parallel (x CP) ranks; the loss is already a share of the batch's loss
            return loss * (n * dp * scale), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=mm.chunks,
        num_microbatches=n,
        seq_length=mm.seq_length(width, cp),
        micro_batch_size=len(mbs[0]), forward_only=False)


def _forward(mm: MegatronModel, chunk, mb: MicroBatch, cp: int, cp_rank: int,
             algo: AlgoConfig | None = None, routing: RoutingStats | None = None):
    """One chunk's output for a micro-batch (this rank's 2 sequence chunks under CP, GPU only:
    context_parallel.py). With `algo`, MoE rows carrying the rollout's routing are compared
    with this chunk's routers into `routing` (and replayed when algo.routing_replay)."""
    routed = (megatron_routing([chunk], mb.routed, mb.routed_valid(),
                               replay=algo.routing_replay, stats=routing)
              if algo is not None and mb.routed is not None else contextlib.nullcontext())
    with routed:
        if cp > 1:
            return mm.forward(chunk, *context_parallel.local_tokens(mb.input_ids, cp, cp_rank,
                                                                    mm.sp_size))
        return mm.forward(chunk, mb.input_ids, attention_mask=mb.attention_mask,
                          media=mb.media.kwargs() if mb.media is not None else None)


def _token_terms(mm: MegatronModel, out, width: int, cp: int, temperature: float,
                 mb: MicroBatch, entropy: str | None = "metric"):
    """log p(next token) and the entropy at each position, [B, T-1], under `temperature`,
    from this TP rank's vocabulary slice of the logits: no rank builds the whole vocabulary's
    (vocab_parallel.py). A multimodal model's media pad tokens get the lowest logit, as the
    engine never samples them (trainer.step.scaled_logits does the same under trainer=torch:
    without it the policy's softmax is not the engine's, ~0.1 apart in log-prob on the tiny VL
    model)."""
    from megatron.core import parallel_state as ps

    if cp > 1:
        out = context_parallel.gather_sequence(out, width)[:, :-1]
    else:
        # the micro-batch's own width (micro-batches are trimmed, narrower than `width`): under
        # sequence parallelism its rows were padded to a multiple of TP (MegatronModel.forward)
        out = out[:, :mb.input_ids.shape[1] - 1]
    tp = ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * out.shape[-1]
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None

    def terms(out, targets):
        shard = vocab_parallel.scaled_shard(out, start, mm.vocab_size, temperature,
                                            mm.banned_ids)
        return vocab_parallel.logprobs_and_entropy(shard, targets, start, group, entropy)

    # trainer.logprob_chunk_size: the float32 tensors of one chunk of positions at a time
    return over_positions(terms, mm.cfg.logprob_chunk_size, out, mb.targets)


def with_old_logprobs(mm: MegatronModel, batch: MicroBatch, algo: AlgoConfig, num_steps: int,
                      micro_batch_size: int, temperature: float) -> MicroBatch:
    """The rows with `old_logp` [rows, T-1]: the policy's log-probs before the step's first
    optimizer step, from a forward-only pass over the same micro-batches the update runs (so
    the first mini-batch's ratio is exactly 1). Filled where the loss is computed (the last
    pipeline stage); other stages never read it."""
    return dataclasses.replace(batch, old_logp=forward_logprobs(
        mm, mm.chunks, batch, algo, num_steps, micro_batch_size, temperature))


def forward_logprobs(mm: MegatronModel, chunks: list, batch: MicroBatch, algo: AlgoConfig | None,
                     num_steps: int, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """Log-probs [rows, T-1] of the rows' tokens under `chunks` (the policy's, or a model built
    like them: the KL reference, megatron/reference.py), from Megatron's forward-only schedule
    over the micro-batches the update runs (`num_steps` mini-batches of `micro_batch_size`
    rows), at every layout (TP's vocabulary slices, PP's stages, CP's chunks). Filled on the
    last pipeline stage, zeros elsewhere. `algo`: MoE rows compare (and, with
    algo.routing_replay, replay) the rollout's routing, as the update does; None: the chunks
    route on their own (the reference: as the transformers replica it replaces)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    width = batch.input_ids.shape[1]
    out = torch.zeros_like(batch.weights)
    for lo, mini in mini_batches(batch, num_steps):
        mbs = micro_batches(mini, micro_batch_size, pipelined)
        starts = [lo + i * micro_batch_size for i in range(len(mbs))]

        def forward_step(data_iterator, chunk):
            row, mb = next(data_iterator)
            output = _forward(mm, chunk, mb, cp, cp_rank, algo=algo,
                              routing=RoutingStats() if algo is not None else None)

            def loss_func(output):
                logp, _ = _token_terms(mm, output, width, cp, temperature, mb, entropy=None)
                out[row:row + len(mb), :logp.shape[1]] = logp
                return logp.new_zeros(()), {}

            return output, loss_func

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(list(zip(starts, mbs))),
                model=chunks, num_microbatches=len(mbs),
                seq_length=mm.seq_length(width, cp),
                micro_batch_size=len(mbs[0]), forward_only=True)
    return out


def _same_keys(sums: dict) -> dict:
    """Ranks that computed no loss (earlier pipeline stages, TP ranks > 0) add zeros under the
    keys the counted ranks have, so the all-reduce lines up."""
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(sums))
    return {k: sums.get(k, 0.0) for k in sorted(set().union(*keys))}


def eval_sums(mm: MegatronModel, batch: MicroBatch, *, micro_batch_size: int
              ) -> dict[str, float]:
    """Forward only (SFT validation): this rank's summed NLL over its rows' trained tokens
    (`weights != 0`) and their count, counted on one rank per data-parallel block (last stage,
    TP and CP rank 0; the others return zeros), so a sum over all ranks is the whole batch's.
    Megatron's schedule with forward_only=True: no gradient, no optimizer."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = micro_batches(batch, micro_batch_size, ps.get_pipeline_model_parallel_world_size() > 1)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    counted = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
               and cp_rank == 0)
    width = batch.input_ids.shape[1]
    sums = {"nll": 0.0, "tokens": 0.0}

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        output = _forward(mm, chunk, mb, cp, cp_rank)

        def loss_func(out):
            logp, _ = _token_terms(mm, out, width, cp, 1.0, mb, entropy=None)  # [B, T-1]
            mask = (mb.weights != 0).float()
            if counted:
                sums["nll"] -= float((logp * mask).sum())
                sums["tokens"] += float(mask.sum())
            return logp.new_zeros(()), {}

        return output, loss_func

    for c in mm.chunks:
        c.eval()
    try:
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=mm.chunks,
                num_microbatches=len(mbs),
                seq_length=mm.seq_length(width, cp),
                micro_batch_size=len(mbs[0]), forward_only=True)
    finally:
        mm.train()
    return sums
