"""Rank 0's part of the trainer's step loop, and the no-op `Peer` the other ranks hold.

Rank 0 alone talks to the broker (batches, versions, heartbeats) and the engines (weight
pushes through the cohort, evaluation), and writes the metrics; trainer/main.py's loop calls
the same methods on every rank, so it reads without rank branches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_slurm.broker.client import BrokerClient
from relax_slurm.broker.stats import BatchStats
from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.config import TrainConfig
from relax_slurm.config.weight_sync import resolve_transport
from relax_slurm.data_position import CHECKPOINT_KEY, Positions
from relax_slurm.engines.client import wait_until_healthy
from relax_slurm.errors import BrokerError, BrokerTimeout
from relax_slurm.metrics.fanout import open_sinks
from relax_slurm.metrics.jsonl import truncate_metrics
from relax_slurm.metrics.rollout_dump import tokenizer_decode, write_dump
from relax_slurm.evaluate import EvalSchedule, Evaluator
from relax_slurm.runtime.control import pending_request, request_stop
from relax_slurm.runtime.plan import address_toward
from relax_slurm.runtime.ports import free_port
from relax_slurm.sample_meta import SampleMeta, metas_of
from relax_slurm.samples import Group
from relax_slurm.trainer.overlap import BackgroundPush, overlap_copy_fits
from relax_slurm.trainer.stop_at import RewardTarget, batch_reward
from relax_slurm.trainer.stream import GroupStream
from relax_slurm.weightsync import WeightSender, resolve_backend
from relax_slurm.weightsync.cohort import Cohort, ResendNeeded
from relax_slurm.weightsync.names import NameCheck
from relax_slurm.weightsync.tensor_sender import TensorSender

log = logging.getLogger("relax_slurm.trainer")
WEIGHT_GROUP = "relax_weights"
POLL_S = 5.0  # one get_batch call parks at most this long, so a stuck run is noticed
FOLLOW_S = 2.0  # how often a re-forming cohort asks the broker for its engine set


def fetch_groups(broker: BrokerClient, cfg: TrainConfig, version: int, num_groups: int,
                 min_groups: int, beat: Callable[[], None] = lambda: None
                 ) -> tuple[list[Group], BatchStats]:
    """`num_groups` groups, or whatever is queued once `min_groups` are, polling every POLL_S
    (each turn also heartbeats: waiting is progress)."""
    deadline = time.monotonic() + cfg.trainer.get_batch_timeout_s
    while time.monotonic() < deadline:
        beat()
        wait = min(POLL_S, cfg.cluster.restart.heartbeat_interval_s,
                   max(deadline - time.monotonic(), 0.1))
        got = broker.get_batch(num_groups, version, wait_s=wait, min_groups=min_groups)
        if got is not None:
            return got
    raise BrokerTimeout(
        f"no batch for policy version {version} within trainer.get_batch_timeout_s="
        f"{cfg.trainer.get_batch_timeout_s}s; check logs/rollout*.log and logs/engine*.log"
    )


def staleness_histogram(stats: BatchStats, max_staleness: int) -> dict[str, float]:
    """The broker's per-batch staleness counts as shares 0..max_staleness: every key on every
    step, so relax-plot can stack them into a histogram over time."""
    counts = stats.staleness_hist
    total = sum(counts.values()) or 1
    return {f"broker/staleness_hist/{k}": counts.get(k, 0) / total
            for k in range(max_staleness + 1)}


def batch_metrics(groups: list[Group], stats: BatchStats) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    metas = [m for m in metas_of(samples) if m is not None]  # (none: no worker's)
    # per group (the same on each of its samples), including groups the worker did not send
    counts = [m for m in map(SampleMeta.of, (g[0] for g in groups)) if m is not None]
    starts = [m.t_start for m in metas if m.t_start is not None]
    ends = [m.t_end for m in metas if m.t_end is not None]
    # per group: from its last response to its rewards (and teacher log-probs) being in
    scoring = [m.t_scored - m.t_end for m in counts
               if m.t_scored is not None and m.t_end is not None]
    n = len(samples)
    # multi-turn runs: model turns per episode, and episodes cut by env.max_turns or
    # env.max_total_tokens rather than ended by the environment
    episodes = [m for m in metas if m.turns is not None]
    turns = [m.turns for m in episodes]
    cut = [(m.episode_end or "done") != "done" for m in episodes]
    return {
        "rollout/reward_mean": batch_reward(groups),
        "rollout/response_len_mean": sum(s.response_len for s in samples) / n,
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
        # samples whose tokens come from more than one policy version (a sync mid-generation)
        "rollout/multi_version_frac": sum(s.multi_version for s in samples) / n,
        # of them, continued from an aborted prefix (pause_mode=abort; per group, counted once)
        "rollout/resumed_frac": sum(c.resumed or 0 for c in counts) / n,
        "rollout/reward_errors": sum(c.reward_errors for c in counts),
        "rollout/filtered_groups": sum(c.filtered_groups for c in counts),
        "broker/staleness_max": stats.staleness_max,
        "broker/staleness_mean": stats.staleness_mean,
        "broker/queue_depth": stats.counters.queue_depth,
        # groups dropped as stale so far (the metric's name since the first)
        "broker/dropped_stale": stats.counters.dropped,
        "broker/auth_refused": stats.auth_refused,
        "broker/dropped_stale_samples": stats.counters.dropped * len(groups[0]),
        "perf/gen_time_s": (max(ends) - min(starts)) if starts and ends else 0.0,
        "perf/score_time_s": sum(scoring) / len(scoring) if scoring else 0.0,
        "train/samples": n,
    } | ({"rollout/turns_mean": sum(turns) / len(turns),
          "rollout/episode_truncated_frac": sum(cut) / len(cut)} if turns else {})


def broker_counters(broker: BrokerClient, version: int) -> dict:
    """What a restarted broker needs: its counters as of `version` (queued groups are not kept)."""
    c = broker.stats().counters
    return {"version": version, "dropped": c.dropped, "consumed": c.consumed,
            "released": c.released}


@dataclass
class StepClock:
    """The step loop's timestamps (time.monotonic): the step's start, the end of its training,
    of its weight push and of its checkpoint; `last_end` is the previous step's end (or the
    first push's), which the step time counts from."""

    last_end: float = field(default_factory=time.monotonic)
    start: float = 0.0
    trained: float = 0.0
    synced: float = 0.0
    saved: float = 0.0

    def begin(self) -> None:
        self.start = time.monotonic()

    def mark(self, moment: str) -> None:
        setattr(self, moment, time.monotonic())

    def end(self) -> None:
        self.last_end = self.saved


def step_row(groups: list[Group], stats: BatchStats, train: dict, stream: GroupStream,
             clock: StepClock, settle_wait_s: float, version: int, max_staleness: int) -> dict:
    """One step's metrics row, but the weight push's (logged once the push is in)."""
    step_s = clock.saved - clock.last_end
    return (batch_metrics(groups, stats) | train | staleness_histogram(stats, max_staleness) | {
        # the wait for groups (the generation not hidden) and the rest of the step's
        # forward/backward/update; streaming interleaves the two
        "perf/trainer_wait_s": stream.wait_s,
        "perf/train_time_s": clock.trained - clock.start - stream.wait_s - settle_wait_s,
        "perf/stream_blocks": stream.blocks,
        "perf/checkpoint_s": clock.saved - clock.synced,
        "perf/step_time_s": step_s,
        "perf/samples_per_s": stream.batch_samples / step_s,
        "policy/version": version,
    })


class RankZero:
    """What only rank 0 holds (the broker client, the weight sender, the metrics sinks) and
    does in each step: take the batch, push the weights, announce the version, log the row.
    The other ranks hold a `Peer`, whose same calls do nothing."""

    def __init__(self, cfg: TrainConfig, plan, run_dir: Path, start_step: int,
                 data_world: int) -> None:
        self.cfg = cfg
        self.block_rows = data_world * cfg.trainer.micro_batch_size  # one streamed block
        self.stream: GroupStream | None = None
        self.groups: list[Group] = []
        self.stats = BatchStats.empty()
        self.step = start_step  # the step whose batch the loop takes or trains now
        self.reward_target = RewardTarget(cfg.trainer.stop_at)
        # the advantages' typed parameters, once per run (the config is validated and fixed)
        self.estimator_params = cfg.algo.estimator_params()
        self.broker = BrokerClient(plan.broker_router, cfg.broker.request_timeout_s,
                                   identity="trainer")
        # the weight push's own socket: an overlapped push talks to the broker from its thread
        # (trainer/overlap.py) while the loop takes the next batch (zmq sockets: one thread)
        self.sync_broker = BrokerClient(plan.broker_router, cfg.broker.request_timeout_s,
                                        identity="trainer-sync")
        self.overlap = (cfg.algo.max_staleness > 0 and cfg.weight_sync.overlap
                        and overlap_copy_fits(cfg))
        # a push made now reads the export as the ranks gather it, bucket by bucket; an
        # overlapped one sends while the next step trains, from a whole copy
        self.streams = not self.overlap
        self.resend = False  # a streamed push was spent on a failed sync: export again
        self.pusher = BackgroundPush()
        self.pending: tuple[int, dict, list[Group]] | None = None
        self.settle_wait_s = 0.0  # this step's wait for the previous version's push
        self.waits: dict[str, Any] = {}
        """What rank 0 waits on now ("batch", "weight_sync", "engines"), sent with every
        heartbeat: the launcher's stall note and relax-ctl status read it (launch/waiting.py).
        Written by the loop and the push's thread; each heartbeat sends a copy."""
        self.sync_pacer = Pacer(cfg.cluster.restart.heartbeat_interval_s)
        # empty host: wherever rank 0 landed (c10d rendezvous picks it on multi-node Slurm
        # runs), by its address on the engines' network
        sync_host = plan.weight_sync_host or address_toward(plan.engine_urls)
        # by reference to engines sharing the trainer's GPUs (weightsync/tensor_sender.py)
        by_reference = resolve_transport(cfg.weight_sync, cfg.rollout.release_memory_during_train,
                                         cfg.cluster) == "tensor"

        def make_sender(group_name: str, port: int, urls: list[str]) -> WeightSender:
            sender = (TensorSender if by_reference else WeightSender)(
                urls, sync_host, port, group_name,
                resolve_backend(cfg.weight_sync.backend,
                                engines_on_gpu=cfg.rollout.engine != "hf"
                                and cfg.rollout.engine_device != "cpu"),
                cfg.weight_sync.timeout_s, cfg.weight_sync.bucket_mb,
                pause_mode=cfg.weight_sync.pause_mode,
                pause_for_sync=cfg.algo.max_staleness > 0,  # on-policy nothing generates
                ranks_per_engine=cfg.rollout.engine_tp_size,
                load_format=cfg.weight_sync.load_format,
                # model.lora: every version the broker may still accept keeps its adapter
                adapter_window=cfg.algo.max_staleness + 1,
            )
            sender.on_wait = self.sync_waiting
            return sender
        # a restarted engine re-joins through a new cohort (weightsync/cohort.py)
        self.cohort = Cohort(plan.engine_urls, WEIGHT_GROUP, plan.weight_sync_port, make_sender,
                             new_port=lambda: free_port(sync_host),
                             # an engine that stopped answering is restarted by the launcher
                             # (or reported lost) once silent for
                             # cluster.restart.heartbeat_timeout_s, and the new one loads
                             # within startup_timeout_s: wait for both
                             startup_timeout_s=(cfg.rollout.startup_timeout_s
                                                + cfg.cluster.restart.heartbeat_timeout_s),
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
        # SGLang skips a name its model lacks without failing the update (weightsync/names.py)
        self.names = NameCheck(cfg.model.path)
        self.num_engines = len(plan.engine_urls)
        self.release_memory = cfg.rollout.release_memory_during_train
        self.pacer = Pacer(cfg.cluster.restart.heartbeat_interval_s)

    @property
    def sender(self) -> WeightSender:
        return self.cohort.sender

    def heartbeat(self, step: int, weights: Callable[[], list] | None = None) -> None:
        """From the step loop (see broker/heartbeat.py): the trainer's loop turns. While it
        waits for a batch it also re-syncs an engine that was restarted (`weights` gives the
        current ones without a collective; None under FSDP2, where that needs every rank)."""
        if self.pacer.due():
            self.broker.heartbeat("trainer", step=step, waiting=dict(self.waits))
            # the engines are a running push's; one that ended waits to be joined until the
            # batch is in (overlap), and a restarted engine must be re-synced before that, or
            # it generates with its initial weights the whole wait (seen on real SGLang)
            if weights is not None and self.pusher.engines_free:
                self.cohort.resync(weights, version=step)

    def heartbeat_waiting(self) -> None:
        """While the cohort waits for a restarting engine (the push's thread is held there)."""
        if self.pacer.due():
            self.sync_broker.heartbeat("trainer", waiting=self.waits | {
                "engines": "every engine to answer again (re-forming the weight-sync cohort)"})

    def sync_waiting(self, pending: list[str]) -> None:
        """From a sync's wait (WeightSender.on_wait, the sending thread): which engines have
        not finished their receive yet."""
        sync = self.waits.get("weight_sync")
        if sync is not None:
            sync["engines"] = pending
        if self.sync_pacer.due():
            self.sync_broker.heartbeat("trainer", waiting=dict(self.waits))

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
        weights = self.names.checked(weights)
        before = list(self.cohort.urls)
        self.waits["weight_sync"] = {"version": version, "engines": before}
        # a stream's tensors are gone once sent: the check reads the digests the send took
        digests: list | None = [] if self.verify and isinstance(weights, Iterator) else None
        try:
            stats = self.cohort.send(weights, version=version, digests=digests)
            if self.verify:
                self.cohort.verify(weights, version, digests)
                log.info("version %d: weights verified bit for bit on %d engine(s)", version,
                         len(self.cohort.urls))
        except ResendNeeded as e:  # the loop exports again, on every rank (trainer/main.py)
            log.warning("%s", e)
            self.resend = True
            return {}
        finally:
            self.waits.pop("weight_sync", None)
        if self.cohort.urls != before:  # followed the broker while re-forming (a lost engine)
            self.num_engines = len(self.cohort.urls)
            report = True
        if report:
            self.sync_broker.engines(synced=self.cohort.urls)
        return stats

    def take_resend(self) -> bool:
        """Whether the last push must be made again from a new export (read once)."""
        resend, self.resend = self.resend, False
        return resend

    def push_and_announce(self, weights: list, version: int) -> dict:
        """The overlapped push's thread: engines serve `version`, then the broker says so."""
        stats = self.push_weights(weights, version)
        self.sync_broker.set_version(version)
        return stats

    def settle(self) -> None:
        """Wait for the overlapped push in flight (if any), then finish its step: evaluate on
        the new weights and log the step's row with the time the loop waited for the push."""
        if not self.pusher.busy:
            return
        sync, waited = self.pusher.join()
        self.settle_wait_s = waited
        step, row, groups = self.pending
        self.pending = None
        done = step + 1
        evals = self.evaluator.after_step(done) if self.evaluator is not None else {}
        self.log_step(step, row | evals | {
            "perf/weight_sync_s": waited, "perf/weight_sync_push_s": self.pusher.took,
            "perf/weight_sync_mb": sync.get("bytes", 0) / 2**20,
            "weight_sync/bytes": sync.get("bytes", 0)}, groups)

    def log_step(self, step: int, row: dict, groups: list[Group]) -> None:
        self.metrics.log(step, row)
        if self.decode is not None:
            write_dump(self.run_dir, step, groups, self.decode)

    # ---- the step loop's calls (trainer/main.py train_loop), in the order it makes them ----
    def start(self, weights: list, version: int) -> None:
        """Engines started from model.path: give them the trainer's weights (a checkpoint's on
        resume), then open admission: nothing is generated with other weights."""
        self.push_weights(weights, version=version)
        if not self.resend:  # else once the export made again is in (trainer/main.py)
            self.broker.set_version(version)

    def open_stream(self, step: int, local_weights: Callable[[], list] | None) -> GroupStream:
        """This step's batch as it arrives (trainer/stream.py); whole batches are taken in full
        here, before the engines free their memory for the trainer."""
        cfg, self.step = self.cfg, step

        def take(n: int, least: int) -> tuple[list[Group], BatchStats]:
            self.waits["batch"] = {"version": step, "groups": n}
            try:
                return fetch_groups(self.broker, cfg, step, n, least,
                                    lambda: self.heartbeat(step, local_weights))
            finally:
                self.waits.pop("batch", None)
        self.settle_wait_s = 0.0
        self.stream = GroupStream(take, cfg.algo, cfg.rollout.batch_size,
                                  cfg.rollout.n_samples_per_prompt, block_rows=self.block_rows,
                                  streaming=cfg.streams, params=self.estimator_params)
        if not cfg.streams:  # whole batches: every group in before engines sleep
            self.stream.fill()
            self.engines_sleep()
        return self.stream

    def note_positions(self, positions: Positions) -> None:
        """The trained batch's groups move each worker's data position (what a resume reads)."""
        self.groups, self.stats = self.stream.batch()
        for g in self.groups:
            positions.note(g)
        self.reward_target.note(self.step + 1, self.groups)

    def push(self, weights: list, version: int) -> dict:
        """The new weights to the engines: beside what follows in an async run with overlap
        (trainer/overlap.py; announced by its thread), else now (announced by finish_step)."""
        self.engines_wake()
        if self.overlap:
            self.pusher.start(lambda: self.push_and_announce(weights, version))
            return {}
        return self.push_weights(weights, version=version)

    def control_request(self) -> str | None:
        """A preempt or stop request on file (runtime/control.py `pending_request`), filed
        here first once trainer.stop_at's reward target is met (trainer/stop_at.py)."""
        reason = self.reward_target.stop_reason()
        if reason is not None:
            request_stop(self.run_dir, reason)
        return pending_request(self.run_dir)

    def checkpoint_extra(self, positions: Positions, version: int) -> dict:
        return {CHECKPOINT_KEY: positions.to_dict(),
                "broker": broker_counters(self.broker, version)}

    def finish_step(self, step: int, train: dict, clock: StepClock, sync: dict) -> None:
        """The step's metrics row; with overlap it waits for the push (settle), else the
        engines serve the new version now and (sync runs) the worker waits for set_version:
        announce, then make and log the row, so that the worker's next batch is under way
        while rank 0 does (~3 ms of a tiny step, which otherwise added to every sync step: the
        bench's sync_bound_ratio). An inline eval (sync runs) comes before the announcement:
        it has the engines to itself."""
        done = step + 1
        if self.overlap:
            self.pending = (step, self.row(step, train, clock), self.groups)
            return
        inline = self.evaluator is not None and self.evaluator.inline(done)
        evals = self.evaluator.after_step(done) if inline else {}
        self.broker.set_version(done)
        if self.evaluator is not None and not inline:
            evals = self.evaluator.after_step(done)
        row = self.row(step, train, clock)
        push_s = clock.synced - clock.trained
        self.log_step(step, row | evals | {
            "perf/weight_sync_s": push_s, "perf/weight_sync_push_s": push_s,
            "perf/weight_sync_mb": sync.get("bytes", 0) / 2**20,
            # the bytes of tensors sent this step: model.lora's adapter alone, or every weight
            "weight_sync/bytes": sync.get("bytes", 0)}, self.groups)

    def row(self, step: int, train: dict, clock: StepClock) -> dict:
        """Step `step`'s metrics row from what this step left here (step_row)."""
        return step_row(self.groups, self.stats, train, self.stream, clock, self.settle_wait_s,
                        step + 1, self.cfg.algo.max_staleness)

    def close(self) -> None:
        self.pusher.close()
        for closeable in (self.cohort, self.broker, self.sync_broker, self.metrics,
                          self.evaluator):
            if closeable is not None:
                closeable.close()


class Peer:
    """Ranks > 0 in the step loop: rank 0's calls, each with nothing to do here (the batch
    reaches them through step_blocks' scatter, the weights leave from rank 0)."""

    streams = False  # what the export gives this rank does not depend on it (sync_share)

    def take_resend(self) -> bool:
        return False  # rank 0's answer is broadcast (ranks.py broadcast_after_push)

    def start(self, weights: list, version: int) -> None:
        pass

    def open_stream(self, step: int, local_weights: Callable[[], list] | None) -> None:
        return None

    def settle(self) -> None:
        pass

    def note_positions(self, positions: Positions) -> None:
        pass

    def push(self, weights: list, version: int) -> dict:
        return {}

    def control_request(self) -> str | None:
        return None  # rank 0 reads the request; broadcast_after_push tells every rank

    def checkpoint_extra(self, positions: Positions, version: int) -> dict:
        return {CHECKPOINT_KEY: positions.to_dict(), "broker": {}}

    def finish_step(self, step: int, train: dict, clock: StepClock, sync: dict) -> None:
        pass

    def close(self) -> None:
        pass
