"""Trainer entry point, run by torchrun: `torchrun ... -m relax_slurm.trainer --run-dir DIR`.

Each step: take a batch from the broker, train on it, push the new weights to the engines,
bump the policy version on the broker, log one metrics line. Rank 0 alone talks to the broker
and the engines; the other ranks get their shard of the batch from rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from relax_slurm.broker.client import BrokerClient
from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.checkpoint import checkpoints_dir
from relax_slurm.checkpoint.dcp import wait_pending
from relax_slurm.runtime.control import PREEMPT_EXIT_CODE, preempt_requested
from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.errors import BrokerError, BrokerTimeout, ConfigError
from relax_slurm.runtime.plan import free_port, load_plan
from relax_slurm.metrics.fanout import open_sinks
from relax_slurm.metrics.jsonl import METRICS_FILE
from relax_slurm.metrics.rollout_dump import tokenizer_decode, write_dump
from relax_slurm.engines.client import wait_until_healthy
from relax_slurm.rollout.evaluate import EvalSchedule, Evaluator
from relax_slurm.samples import Group, note_position
from relax_slurm.trainer.backend import build_backend
from relax_slurm.trainer.overlap import BackgroundPush
from relax_slurm.trainer.stream import GroupStream, step_blocks
from relax_slurm.weightsync import WeightSender
from relax_slurm.weightsync.cohort import Cohort

log = logging.getLogger("relax_slurm.trainer")
WEIGHT_GROUP = "relax_weights"
POLL_S = 5.0  # one get_batch call parks at most this long, so a stuck run is noticed
FOLLOW_S = 2.0  # how often a re-forming cohort asks the broker for its engine set


def check_batch_divides(cfg: TrainConfig, world: int) -> None:
    """`world`: data-parallel ranks (all ranks for the torch backend; ranks / (TP x PP) for
    megatron)."""
    n = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    if n % world:
        raise ConfigError(
            f"rollout.batch_size x rollout.n_samples_per_prompt = {n} samples per step does not "
            f"split evenly over {world} data-parallel trainer ranks; change rollout.batch_size "
            "or trainer.nproc_per_node"
        )
    steps = cfg.trainer.num_steps_per_rollout
    if n % (world * steps):
        raise ConfigError(
            f"{n} samples per step over {world} data-parallel ranks do not cut into "
            f"trainer.num_steps_per_rollout={steps} equal mini-batches on every rank: make "
            f"rollout.batch_size x rollout.n_samples_per_prompt a multiple of {world * steps}"
        )


def fetch_groups(broker: BrokerClient, cfg: TrainConfig, version: int, num_groups: int,
                 min_groups: int, beat: Callable[[], None] = lambda: None
                 ) -> tuple[list[Group], dict]:
    """`num_groups` groups, or whatever is queued once `min_groups` are, polling every POLL_S
    (each turn also heartbeats: waiting is progress)."""
    deadline = time.monotonic() + cfg.trainer.get_batch_timeout_s
    while time.monotonic() < deadline:
        beat()
        wait = min(POLL_S, cfg.cluster.heartbeat_interval_s,
                   max(deadline - time.monotonic(), 0.1))
        got = broker.get_batch(num_groups, version, wait_s=wait, min_groups=min_groups)
        if got is not None:
            return got
    raise BrokerTimeout(
        f"no batch for policy version {version} within trainer.get_batch_timeout_s="
        f"{cfg.trainer.get_batch_timeout_s}s; check logs/rollout*.log and logs/engine*.log"
    )


def staleness_histogram(stats: dict, max_staleness: int) -> dict[str, float]:
    """The broker's per-batch staleness counts as shares 0..max_staleness: every key on every
    step, so relax-plot can stack them into a histogram over time."""
    counts = {int(k): v for k, v in stats.get("staleness_hist", {}).items()}
    total = sum(counts.values()) or 1
    return {f"broker/staleness_hist/{k}": counts.get(k, 0) / total
            for k in range(max_staleness + 1)}


def batch_metrics(groups: list[Group], stats: dict) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    # per group (the same on each of its samples), including groups the worker did not send
    counts = [g[0].metadata for g in groups]
    starts = [s.metadata.get("t_start") for s in samples if "t_start" in s.metadata]
    ends = [s.metadata.get("t_end") for s in samples if "t_end" in s.metadata]
    n = len(samples)
    # multi-turn runs: model turns per episode, and episodes cut by env.max_turns or
    # env.max_total_tokens rather than ended by the environment
    turns = [s.metadata["turns"] for s in samples if "turns" in s.metadata]
    cut = [s.metadata.get("episode_end", "done") != "done" for s in samples if "turns" in s.metadata]
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(s.response_len for s in samples) / n,
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
        # samples whose tokens come from more than one policy version (a sync mid-generation)
        "rollout/multi_version_frac": sum(s.multi_version for s in samples) / n,
        "rollout/reward_errors": sum(int(c.get("reward_errors", 0)) for c in counts),
        "rollout/filtered_groups": sum(int(c.get("filtered_groups", 0)) for c in counts),
        "broker/staleness_max": stats.get("staleness_max", 0),
        "broker/staleness_mean": stats.get("staleness_mean", 0.0),
        "broker/queue_depth": stats.get("queue_depth", 0),
        "broker/dropped_stale": stats.get("dropped_stale", 0),
        "broker/auth_refused": stats.get("auth_refused", 0),
        "broker/dropped_stale_samples": stats.get("dropped_stale", 0) * len(groups[0]),
        "perf/gen_time_s": (max(ends) - min(starts)) if starts and ends else 0.0,
        "train/samples": n,
    } | ({"rollout/turns_mean": sum(turns) / len(turns),
          "rollout/episode_truncated_frac": sum(cut) / len(cut)} if turns else {})


def init_distributed(cfg: TrainConfig) -> torch.device:
    # every collective waits at most this long: ranks 1.. wait in scatter while rank 0 waits
    # for the broker, so the bound must cover a batch fetch
    timeout = datetime.timedelta(seconds=cfg.trainer.get_batch_timeout_s + 300)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(cfg.trainer.torch_threads)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


class RankZero:
    """What only rank 0 holds: the broker client, the weight sender, the metrics sinks."""

    def __init__(self, cfg: TrainConfig, plan, run_dir: Path, start_step: int) -> None:
        self.broker = BrokerClient(plan.broker_router, cfg.broker.request_timeout_s,
                                   identity="trainer")
        # the weight push's own socket: an overlapped push talks to the broker from its thread
        # (trainer/overlap.py) while the loop takes the next batch (zmq sockets: one thread)
        self.sync_broker = BrokerClient(plan.broker_router, cfg.broker.request_timeout_s,
                                        identity="trainer-sync")
        self.overlap = cfg.algo.max_staleness > 0 and cfg.weight_sync.overlap
        self.push = BackgroundPush()
        self.pending: tuple[int, dict, list[Group]] | None = None
        self.settle_wait_s = 0.0  # this step's wait for the previous version's push
        # empty host: wherever rank 0 landed (c10d rendezvous picks it on multi-node Slurm runs)
        sync_host = plan.weight_sync_host or socket.gethostname()
        def make_sender(group_name: str, port: int, urls: list[str]) -> WeightSender:
            return WeightSender(
                urls, sync_host, port, group_name,
                cfg.weight_sync.backend, cfg.weight_sync.timeout_s, cfg.weight_sync.bucket_mb,
                pause_mode=cfg.weight_sync.pause_mode,
                pause_for_sync=cfg.algo.max_staleness > 0,  # on-policy nothing generates
                ranks_per_engine=cfg.rollout.engine_tp_size,
                load_format=cfg.weight_sync.load_format,
            )
        # a restarted engine re-joins through a new cohort (weightsync/cohort.py)
        self.cohort = Cohort(plan.engine_urls, WEIGHT_GROUP, plan.weight_sync_port, make_sender,
                             new_port=lambda: free_port(sync_host),
                             # an engine that stopped answering is restarted by the launcher
                             # (or reported lost) once silent for heartbeat_timeout_s, and the
                             # new one loads within startup_timeout_s: wait for both
                             startup_timeout_s=(cfg.rollout.startup_timeout_s
                                                + cfg.cluster.heartbeat_timeout_s),
                             waiting=self.heartbeat_waiting, follow=self.broker_cohort)
        self.follow_pacer = Pacer(FOLLOW_S)
        # every role starts at once: the engines may still be loading their models
        wait_until_healthy(plan.engine_urls, cfg.rollout.startup_timeout_s)
        self.cohort.connect()
        truncate_metrics(run_dir, start_step)
        self.metrics = open_sinks(cfg, run_dir)
        self.run_dir = run_dir
        self.decode = (tokenizer_decode(cfg.model.path, cfg.model.trust_remote_code)
                       if cfg.debug.dump_rollouts else None)
        evaluator = (Evaluator(cfg, plan.engine_urls, plan.reward_config(cfg.reward))
                     if cfg.eval.every else None)
        self.evaluator = (EvalSchedule(evaluator, cfg.eval.every, cfg.trainer.total_steps,
                                       background=cfg.algo.max_staleness > 0)
                          if cfg.eval.every else None)
        self.verify = cfg.weight_sync.verify
        self.num_engines = len(plan.engine_urls)
        self.release_memory = cfg.rollout.release_memory_during_train
        self.pacer = Pacer(cfg.cluster.heartbeat_interval_s)

    @property
    def sender(self) -> WeightSender:
        return self.cohort.sender

    def heartbeat(self, step: int, weights: Callable[[], list] | None = None) -> None:
        """From the step loop (see broker/heartbeat.py): the trainer's loop turns. While it
        waits for a batch it also re-syncs an engine that was restarted (`weights` gives the
        current ones without a collective; None under FSDP2, where that needs every rank)."""
        if self.pacer.due():
            self.broker.heartbeat("trainer", step=step)
            if weights is not None and not self.push.busy:  # the engines are the push's
                self.cohort.resync(weights, version=step)

    def heartbeat_waiting(self) -> None:
        """While the cohort waits for a restarting engine (the push's thread is held there)."""
        if self.pacer.due():
            self.sync_broker.heartbeat("trainer", waiting_for="engines")

    def broker_cohort(self) -> list[str] | None:
        """The broker's engine set, asked at most every FOLLOW_S while the cohort waits for its
        engines: one the launcher reported lost (broker/elastic.py) must not be waited for."""
        if not self.follow_pacer.due():
            return None
        try:
            return self.sync_broker.engines()["cohort"]
        except (BrokerError, BrokerTimeout):  # the broker restarting: ask again later
            return None

    def engines_sleep(self) -> None:
        """Shared GPUs: the rollout of this step is in, so engines free their memory for the
        trainer (on-policy only: the worker waits for the next version)."""
        if self.release_memory:
            self.sender.release_memory()
            log.info("engines released their memory for the trainer step")

    def engines_wake(self) -> None:
        """Shared GPUs: memory back before the weights arrive and the next rollout starts."""
        if self.release_memory:
            self.sender.resume_memory()
            log.info("engines resumed their memory")

    def follow_engines(self) -> bool:
        """Elastic rollout (broker/elastic.py): make the cohort the broker's engine set (engines
        joining with their operation at WEIGHT_SYNCING, minus those detaching); True when the
        broker must hear of it once the weights are sent."""
        view = self.sync_broker.engines()
        report = any(e["state"] in ("joining", "detaching") for e in view["engines"])
        if view["cohort"] and view["cohort"] != self.cohort.urls:
            self.cohort.move(view["cohort"])
            self.num_engines = len(view["cohort"])
            report = True
        return report

    def push_weights(self, weights: list, version: int) -> dict:
        """Engines serve `version` once this returns (checked bit for bit with verify=true).
        The engine set follows the broker's first: new engines get this version before the
        worker routes to them, leaving ones leave the cohort before the launcher stops them."""
        report = self.follow_engines()
        before = list(self.cohort.urls)
        stats = self.cohort.send(weights, version=version)
        if self.cohort.urls != before:  # followed the broker while re-forming (a lost engine)
            self.num_engines = len(self.cohort.urls)
            report = True
        if report:
            self.sync_broker.engines(synced=self.cohort.urls)
        if self.verify:
            self.cohort.verify(weights, version)
            log.info("version %d: weights verified bit for bit on %d engine(s)", version,
                     self.num_engines)
        return stats

    def push_and_announce(self, weights: list, version: int) -> dict:
        """The overlapped push's thread: engines serve `version`, then the broker says so."""
        stats = self.push_weights(weights, version)
        self.sync_broker.set_version(version)
        return stats

    def settle(self) -> None:
        """Wait for the overlapped push in flight (if any), then finish its step: evaluate on
        the new weights and log the step's row with the time the loop waited for the push."""
        if not self.push.busy:
            return
        sync, waited = self.push.join()
        self.settle_wait_s = waited
        step, row, groups = self.pending
        self.pending = None
        done = step + 1
        evals = self.evaluator.after_step(done) if self.evaluator is not None else {}
        self.log_step(step, row | evals | {
            "perf/weight_sync_s": waited, "perf/weight_sync_push_s": self.push.took,
            "perf/weight_sync_mb": sync.get("bytes", 0) / 2**20}, groups)

    def log_step(self, step: int, row: dict, groups: list[Group]) -> None:
        self.metrics.log(step, row)
        if self.decode is not None:
            write_dump(self.run_dir, step, groups, self.decode)

    def close(self) -> None:
        self.push.close()
        for closeable in (self.cohort, self.broker, self.sync_broker, self.metrics,
                          self.evaluator):
            if closeable is not None:
                closeable.close()


def truncate_metrics(run_dir: Path, start_step: int) -> None:
    """On resume, forget steps logged after the checkpoint: they are trained again."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) < start_step]
    # a new file put in place, not the old one rewritten: the launcher tails this file, and a
    # rewrite that grew past its read offset before its next read looked like more rows
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in rows))
    tmp.replace(path)


def broker_counters(broker: BrokerClient, version: int) -> dict:
    """What a restarted broker needs: its counters as of `version` (queued groups are not kept)."""
    stats = broker.stats()
    return {"version": version, "dropped": stats.get("dropped", 0),
            "consumed": stats.get("consumed", 0), "released": stats.get("released", 0)}


def broadcast_flag(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.broadcast(t, src=0)
    return bool(t.item())


def run(run_dir: Path) -> int:
    cfg = load_config(run_dir / "config.yaml")
    plan = load_plan(run_dir)
    if cfg.supervised:  # algo=sft: the trainer alone, on a dataset (trainer/sft.py)
        from relax_slurm.trainer.sft import run_sft

        return run_sft(cfg, plan, run_dir)
    device = init_distributed(cfg)
    rank = dist.get_rank()
    torch.manual_seed(cfg.trainer.seed)
    backend = build_backend(cfg, device)  # trainer.backend: model, optimizer, checkpoints
    data_world = len(set(backend.data_ranks))
    check_batch_divides(cfg, data_world)
    start_step, extra = 0, {}
    if plan.resume_from:
        extra = backend.load(plan.resume_from)
        start_step = extra["step"]
        log.info("resumed from %s at step %d", plan.resume_from, start_step)
    rollout_states: dict = extra.get("rollout", {})
    freeze_heap()

    zero = RankZero(cfg, plan, run_dir, start_step) if rank == 0 else None
    ckpt_root = checkpoints_dir(run_dir)
    try:
        # engines started from model.path; give them the trainer's weights (a checkpoint's on
        # resume), then open admission: nothing is generated with other weights
        weights = list(backend.named_hf_weights())
        if rank == 0:
            zero.push_weights(weights, version=start_step)
            zero.broker.set_version(start_step)
        last_end = time.monotonic()
        # rank 0 re-sends to a restarted engine on its own where it holds whole tensors
        local_weights = backend.local_weights()
        for step in range(start_step, cfg.trainer.total_steps):
            t0 = time.monotonic()
            stream = None
            if rank == 0:
                def take(n: int, least: int, step: int = step) -> tuple[list[Group], dict]:
                    return fetch_groups(zero.broker, cfg, step, n, least,
                                        lambda: zero.heartbeat(step, local_weights))
                zero.settle_wait_s = 0.0
                stream = GroupStream(take, cfg.algo, cfg.rollout.batch_size,
                                     cfg.rollout.n_samples_per_prompt,
                                     block_rows=data_world * cfg.trainer.micro_batch_size,
                                     streaming=cfg.streams)
                if not cfg.streams:  # whole batches: every group in before engines sleep
                    stream.fill()
                    zero.engines_sleep()
            # an overlapped push of the previous version ends before the weights change
            train = backend.train_step(
                step_blocks(stream, backend.pad_id, device, backend.data_ranks),
                before_update=zero.settle if rank == 0 else lambda: None)
            t1 = time.monotonic()
            if rank == 0:
                groups, stats = stream.batch()
                for g in groups:
                    note_position(rollout_states, g)
            done = step + 1
            # a collective under FSDP2 and megatron (gathered over TP/PP): every rank
            weights = list(backend.named_hf_weights())
            sync = {}
            if rank == 0:
                zero.engines_wake()
                if zero.overlap:  # async: the push runs beside what follows (trainer/overlap.py)
                    zero.push.start(lambda w=weights, v=done: zero.push_and_announce(w, v))
                else:
                    sync = zero.push_weights(weights, version=done)
            t2 = time.monotonic()
            preempt = broadcast_flag(rank == 0 and preempt_requested(run_dir))
            final = preempt or done == cfg.trainer.total_steps
            if final or (cfg.trainer.save_every and done % cfg.trainer.save_every == 0):
                # before set_version: in sync mode the worker is idle, so the data position
                # saved is exactly where the next batch starts
                extra = {"rollout": rollout_states,
                         "broker": broker_counters(zero.broker, done) if rank == 0 else {}}
                handle = backend.save(
                    ckpt_root, done, extra, keep_last=cfg.trainer.keep_last,
                    async_save=cfg.trainer.async_save, hf_assets_src=cfg.model.path)
                if final:
                    handle.wait()
            if cfg.trainer.save_hf_every and done % cfg.trainer.save_hf_every == 0:
                backend.save_hf(run_dir / "hf" / f"step_{done}")
            t3 = time.monotonic()
            if rank == 0:
                row = (batch_metrics(groups, stats) | train
                       | staleness_histogram(stats, cfg.algo.max_staleness) | {
                    # the wait for groups (the generation not hidden) and the rest of the
                    # step's forward/backward/update; streaming interleaves the two
                    "perf/trainer_wait_s": stream.wait_s,
                    "perf/train_time_s": t1 - t0 - stream.wait_s - zero.settle_wait_s,
                    "perf/stream_blocks": stream.blocks,
                    "perf/checkpoint_s": t3 - t2,
                    "perf/step_time_s": t3 - last_end,
                    "perf/samples_per_s": stream.batch_samples / (t3 - last_end),
                    "policy/version": done,
                })
                if zero.overlap:  # logged once the push is in (settle)
                    zero.pending = (step, row, groups)
                else:
                    # engines serve `done` and (sync runs) the worker waits for set_version:
                    # evaluate now
                    evals = (zero.evaluator.after_step(done)
                             if zero.evaluator is not None else {})
                    zero.broker.set_version(done)
                    zero.log_step(step, row | evals | {
                        "perf/weight_sync_s": t2 - t1, "perf/weight_sync_push_s": t2 - t1,
                        "perf/weight_sync_mb": sync.get("bytes", 0) / 2**20}, groups)
            last_end = t3
            if preempt:
                if rank == 0:
                    zero.settle()
                log.info("preempted: checkpoint step_%d saved; exiting for requeue", done)
                wait_pending()
                return PREEMPT_EXIT_CODE
        if rank == 0:
            zero.settle()
        wait_pending()
        return 0
    finally:
        if zero is not None:
            zero.close()
        backend.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    exit_now(run(args.run_dir))  # run() closed everything; skip seconds of interpreter teardown


if __name__ == "__main__":
    main()
