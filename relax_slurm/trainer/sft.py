"""Supervised fine-tuning (`algo=sft`): the trainer alone, on a dataset's targets.

    relax-train experiment=tiny_sft_cpu run_dir=runs/sft            # warm-start
    relax-train experiment=tiny_cpu model.path=runs/sft/hf/step_N   # then RL from its export

Each step rank 0 takes the next `sft.batch_size` rows (epochs of seeded permutations,
`data.seed + epoch`, batches running on across epoch ends), turns them into the same
`TrainItem`s and padded `MicroBatch` block an RL step scatters (prompt tokens weigh 0), and
every rank calls `backend.train_step`: the loss is the registered `sft` algorithm's through the
shared `token_loss` (trainer/step.py), so both trainer backends run it unchanged. No broker, engines,
rollout worker or weight sync. Checkpoints are the RL loop's (same `save`/`load`, resumable;
`extra["sft"]` is the data position); the last step also writes an HF export,
`run_dir/hf/step_<N>`, which is what an RL run takes as `model.path`.

Simplifications: rows are not packed (each is one padded row of the block); no gradient
accumulation beyond the backend's micro-batches; validation is the token-mean NLL of
`sft.val_files` (a forward-only pass on either backend).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relax_slurm.algos import reduction_weights
from relax_slurm.checkpoint import checkpoints_dir
from relax_slurm.checkpoint.dcp import wait_pending
from relax_slurm.config import TrainConfig
from relax_slurm.data.sft import EpochSampler, SFTExample, read_examples
from relax_slurm.errors import ConfigError
from relax_slurm.runtime.control import pending_request
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.metrics.fanout import open_sinks
from relax_slurm.samples import Sample
from relax_slurm.trainer import collectives
from relax_slurm.trainer.backend import build_backend
from relax_slurm.trainer.batch import MicroBatch, TrainItem, collate, scatter_batch

log = logging.getLogger("relax_slurm.trainer")
# policy_loss sums that mean nothing without rollouts: "rollout log-probs" are zeros here
_NOT_LOGGED = ("train/clipfrac", "train/rollout_train_logprob_diff")


def train_items(examples: list[SFTExample], reduction: str) -> list[TrainItem]:
    """The rows as the trainer's items: loss weights over the whole batch (token_mean: each
    trained token 1 / the batch's trained tokens), advantage 1, no rollout log-probs."""
    samples = [Sample(prompt_id=str(i), group_id=i, prompt_ids=e.prompt_ids,
                      response_ids=e.response_ids, loss_mask=e.loss_mask,
                      rollout_logprobs=np.zeros(len(e.response_ids), dtype=np.float32))
               for i, e in enumerate(examples)]
    weights = reduction_weights([torch.from_numpy(s.loss_mask) for s in samples], reduction)
    return [TrainItem(sample=s, advantage=1.0, weights=w.numpy())
            for s, w in zip(samples, weights)]


def padded(examples: list[SFTExample], multiple: int) -> list[SFTExample]:
    """Rows made a multiple of `multiple` (equal blocks per data rank) with copies of the first
    row that train nothing (mask 0)."""
    extra = -len(examples) % multiple
    e = examples[0]
    return examples + [SFTExample(e.prompt_ids, e.response_ids, np.zeros_like(e.loss_mask))
                       for _ in range(extra)]


def scatter_rows(examples: list[SFTExample] | None, reduction: str, pad_id: int,
                 device: torch.device, data_ranks: list[int]) -> MicroBatch:
    """Rank 0 passes the rows, the others None; every rank gets its block. Collective."""
    whole = None
    if dist.get_rank() == 0:
        whole = collate(train_items(examples, reduction), pad_id, torch.device("cpu"))
    return scatter_batch(whole, device, data_ranks)


class Validation:
    """Held-out rows (`sft.val_files`) and when to score them (every `sft.val_every` steps
    and after the last); scored by every rank on its block, summed over ranks."""

    def __init__(self, cfg: TrainConfig, tokenizer, data_world: int) -> None:
        self.enabled = bool(cfg.sft.val_files)  # every rank knows; rank 0 holds the rows
        self.every, self.total = cfg.sft.val_every, cfg.trainer.total_steps
        self.rows = (padded(read_examples(cfg.sft.val_files, cfg.data, cfg.sft, tokenizer),
                            data_world)
                     if tokenizer is not None and cfg.sft.val_files else None)

    def due(self, done: int) -> bool:
        return self.enabled and (done == self.total
                                 or bool(self.every) and done % self.every == 0)

    def score(self, backend, device: torch.device) -> dict[str, float]:
        block = scatter_rows(self.rows, "token_sum", backend.pad_id, device, backend.data_ranks)
        sums = backend.eval_sums(block)
        nll, tokens = collectives.all_reduce_sum([sums["nll"], sums["tokens"]])
        return {"val/loss": nll / max(tokens, 1.0), "val/tokens": tokens}


def open_rows(cfg: TrainConfig, rank: int, data_world: int
              ) -> tuple[list[SFTExample], EpochSampler | None, Validation]:
    """Rank 0 reads and tokenizes the training and held-out rows (the others hold none)."""
    if rank != 0:
        return [], None, Validation(cfg, None, data_world)
    from relax_slurm.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    rows = read_examples(cfg.data.train_files, cfg.data, cfg.sft, tokenizer)
    check_length(cfg, len(rows))
    log.info("SFT on %d rows: %.2f steps per epoch", len(rows), len(rows) / cfg.sft.batch_size)
    return (rows, EpochSampler(len(rows), cfg.data.seed, cfg.data.shuffle),
            Validation(cfg, tokenizer, data_world))


def check_length(cfg: TrainConfig, num_rows: int) -> None:
    """The run's rows fit in data.num_epochs passes (the run stops at trainer.total_steps)."""
    need = cfg.trainer.total_steps * cfg.sft.batch_size
    if need > cfg.data.num_epochs * num_rows:
        raise ConfigError(
            f"trainer.total_steps={cfg.trainer.total_steps} x sft.batch_size="
            f"{cfg.sft.batch_size} rows need {need / num_rows:.2f} passes over the {num_rows} "
            f"rows, more than data.num_epochs={cfg.data.num_epochs}: raise data.num_epochs or "
            "lower trainer.total_steps")


def save_step(cfg: TrainConfig, backend, run_dir: Path, done: int, final: bool,
              sampler: EpochSampler | None) -> None:
    """The RL loop's cadence (trainer.save_every, trainer.save_hf_every, always at the end),
    plus an HF export after the last step: what an RL run takes as model.path. Collective."""
    t = cfg.trainer
    if final or (t.save_every and done % t.save_every == 0):
        extra = {"sft": sampler.state_dict() if sampler is not None else {}}
        handle = backend.save(checkpoints_dir(run_dir), done, extra, keep_last=t.keep_last,
                              async_save=t.async_save, hf_assets_src=cfg.model.path)
        if final:
            handle.wait()
    if done == t.total_steps or (t.save_hf_every and done % t.save_hf_every == 0):
        out = run_dir / "hf" / f"step_{done}"
        backend.save_hf(out)
        if done == t.total_steps:
            log.info("HF export for RL: model.path=%s", out)


def run_sft(cfg: TrainConfig, plan, run_dir: Path) -> int:
    """The SFT run on this rank: rows, then per step train, validate when due, checkpoint,
    log (rank 0). Returns the exit code (PREEMPT_EXIT_CODE after a preemption's checkpoint, 0
    at the end and after a stop's)."""
    from relax_slurm.trainer.ranks import end_on_request, init_distributed

    device = init_distributed(cfg)
    rank = dist.get_rank()
    torch.manual_seed(cfg.trainer.seed)
    backend = build_backend(cfg, device)
    data_world = data_parallel_size(cfg, backend)
    rows, sampler, validation = open_rows(cfg, rank, data_world)
    start_step = resume(backend, plan.resume_from, sampler)
    freeze_heap()
    sinks = open_metrics(cfg, run_dir, start_step) if rank == 0 else None
    steps = SFTSteps(cfg, run_dir, backend, device, rank, rows, sampler, validation, sinks)
    try:
        for step in range(start_step, cfg.trainer.total_steps):
            request = steps.run(step)
            if request is not None:  # preempt or stop, after its checkpoint
                wait_pending()
                return end_on_request(request, step + 1)
        wait_pending()
        return 0
    finally:
        if sinks is not None:
            sinks.close()
        backend.close()
        dist.destroy_process_group()


def data_parallel_size(cfg: TrainConfig, backend) -> int:
    """The backend's data-parallel ranks, which sft.batch_size must split over."""
    data_world = len(set(backend.data_ranks))
    if cfg.sft.batch_size % data_world:
        raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} does not split over "
                          f"{data_world} data-parallel ranks: make it a multiple of {data_world}")
    return data_world


def resume(backend, resume_from: str | None, sampler: EpochSampler | None) -> int:
    """The step to start from: 0, or the checkpoint's, with the backend's state and the data
    position loaded from it."""
    if not resume_from:
        return 0
    extra = backend.load(resume_from)
    if sampler is not None and "sft" in extra:
        sampler.load_state_dict(extra["sft"])
    log.info("resumed from %s at step %d", resume_from, extra["step"])
    return extra["step"]


def open_metrics(cfg: TrainConfig, run_dir: Path, start_step: int):
    """Rank 0's metric sinks, metrics.jsonl cut back to the steps before start_step."""
    from relax_slurm.metrics.jsonl import truncate_metrics

    truncate_metrics(run_dir, start_step)
    return open_sinks(cfg, run_dir)


class SFTSteps:
    """One SFT step on this rank: take rows (rank 0), scatter, train, validate when due,
    checkpoint, log (rank 0)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, backend, device: torch.device, rank: int,
                 rows: list[SFTExample], sampler: EpochSampler | None, validation: Validation,
                 sinks) -> None:
        self.cfg, self.run_dir, self.backend, self.device, self.rank = (
            cfg, run_dir, backend, device, rank)
        self.rows, self.sampler, self.validation, self.sinks = rows, sampler, validation, sinks
        self.last_end = time.monotonic()

    def run(self, step: int) -> str | None:
        """Step `step` (0-based); the control request that ends the run here (preempt, stop;
        its checkpoint is saved), None to carry on."""
        from relax_slurm.trainer.ranks import broadcast_request

        cfg, backend, rank = self.cfg, self.backend, self.rank
        t0 = time.monotonic()
        batch = ([self.rows[i] for i in self.sampler.take(cfg.sft.batch_size)] if rank == 0
                 else None)
        block = scatter_rows(batch, cfg.algo.loss_reduction, backend.pad_id, self.device,
                             backend.data_ranks)
        train = backend.train_step([(block, True)])
        t1 = time.monotonic()
        done = step + 1
        evals = (self.validation.score(backend, self.device) if self.validation.due(done)
                 else {})
        request = broadcast_request(pending_request(self.run_dir) if rank == 0 else None)
        final = request is not None or done == cfg.trainer.total_steps
        t2 = time.monotonic()
        save_step(cfg, backend, self.run_dir, done, final, self.sampler)
        t3 = time.monotonic()
        if rank == 0:
            self.sinks.log(step, {k: v for k, v in train.items() if k not in _NOT_LOGGED}
                           | evals | {"train/samples": len(batch),
                                      "sft/epoch": self.sampler.epochs_done,
                                      "perf/train_time_s": t1 - t0, "perf/eval_s": t2 - t1,
                                      "perf/checkpoint_s": t3 - t2,
                                      "perf/step_time_s": t3 - self.last_end,
                                      "policy/version": done})
        self.last_end = t3
        return request
