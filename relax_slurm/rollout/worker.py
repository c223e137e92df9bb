"""Rollout worker: prompts -> engines -> rewards (+ teacher) -> groups -> broker.

With rollout.agent_mode=proxy it serves the OpenAI-compatible proxy instead (rollout/proxy.py):
external agent programs drive the conversations and give the rewards; the groups go to the
broker the same way.

`python -m relax_slurm.rollout --run-dir DIR` (see rollout/__main__.py). This module is the
admission loop: one asyncio loop drives many prompt groups at once; it asks the broker for
admission credits (which is what bounds staleness), starts one task per admitted prompt, and
hands each to the run's mode, which holds the services it needs (rollout/services.py) and not
the worker: single-turn (rollout/single_turn.py: `n_samples_per_prompt` responses from one
engine, tasks started together sharing one batched request, rollout/coalesce.py) or
environment episodes (rollout/episodes.py). Each scores its responses in the reward pool
(worker processes with a timeout), asks the teacher engine for their log-probs when the run
has one (on-policy distillation) and puts the group on the broker. The worker cannot tell an
SGLang server from the hf engine: both speak the same HTTP protocol. A sequence a weight sync
aborts (weight_sync.pause_mode=abort) is continued from its prefix on the new weights
(rollout/partial.py, rollout.partial_rollout).

Data-side algorithm knobs applied by every mode (pure functions in rewards/shaping.py):
- `algo.overlong_buffer_tokens`: the soft overlong penalty is added to each reward;
- `algo.dynamic_sampling`: a group whose (penalised) rewards are all equal is not put on the
  broker; its credit is released, so the loop admits and samples another prompt instead.
Events of groups that never reach the broker (filtered groups, their reward errors) ride in the
metadata of the next group that does, so the trainer's metrics count them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.data_position import DataPosition, resume_position
from relax_slurm.data import Prompt, PromptDataset, load_tokenizer
from relax_slurm.errors import BrokerShutdown, ConfigError, EngineAborted, EngineUnreachable
from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.runtime.plan import load_plan
from relax_slurm.runtime.stacks import register_stack_dumps
from relax_slurm.engines.client import wait_until_healthy
from relax_slurm.rollout.episodes import EnvEpisodes
from relax_slurm.rollout.services import GroupIds, RolloutServices
from relax_slurm.rollout.single_turn import SingleTurn

if TYPE_CHECKING:
    from relax_slurm.rollout.proxy import AgentProxy

log = logging.getLogger("relax_slurm.rollout")
ENGINE_RETRY_S = 2.0  # a group whose engine is unreachable waits this long before its retry
ACQUIRE_WAIT_S = 2.0  # one parked admission request; short so shutdown is noticed promptly
STOP_GRACE_S = 8.0  # after SIGTERM: more than the proxy's own shutdown grace (5 s), less than
# the launcher's before it SIGKILLs (launch/processes.py TERM_GRACE_S, 10 s)


class RolloutWorker:
    """The admission loop: credits from the broker -> one task per prompt, run by `self.mode`
    (SingleTurn or EnvEpisodes; None with rollout.agent_mode=proxy, whose AgentProxy
    `self.proxy()` builds); heartbeats, elastic engine set, re-queued groups, rejoin."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, worker_rank: int = 0, num_workers: int = 1):
        plan = load_plan(run_dir)
        self.cfg = cfg
        tokenizer = load_tokenizer(cfg.model.path)
        self.proxy_url = plan.proxy_url  # rollout.agent_mode=proxy: external agents drive
        if (cfg.rollout.agent_mode == "proxy") != bool(self.proxy_url):
            raise ConfigError(f"rollout.agent_mode={cfg.rollout.agent_mode} but the run plan "
                              f"has proxy_url={self.proxy_url}: start the run with relax-train")
        # the proxy's sessions come from external agents, not from the dataset
        self.dataset = (PromptDataset(cfg.data, tokenizer) if cfg.rollout.agent_mode == "env"
                        else None)
        pos = resume_position(plan.resume_from, worker_rank)
        if pos is not None and pos.data_state is not None and self.dataset is not None:
            self.dataset.load_state_dict(pos.data_state)
            log.info("resumed data position %s, next group id %d", pos.data_state,
                     pos.next_group_id)
        first_group_id = worker_rank if pos is None else pos.next_group_id
        self.services = RolloutServices.build(cfg, plan, tokenizer, worker_rank,
                                              GroupIds(first_group_id, num_workers))
        self.judge_url = plan.genrm_url  # the managed judge (genrm rewards), waited for
        self.mode = self._mode(cfg)
        self.worker_rank = worker_rank
        self.role = "rollout" if worker_rank == 0 else f"rollout{worker_rank}"
        self.stop = asyncio.Event()
        self.failed: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self.requeued: deque[tuple[Prompt, int, dict]] = deque()
        self.requeued_total = 0

    def _mode(self, cfg: TrainConfig) -> SingleTurn | EnvEpisodes | None:
        """What runs an admitted prompt; a bad environment or media setting fails now."""
        if cfg.data.multimodal_keys and cfg.env.name:
            raise ConfigError(f"data.multimodal_keys with env.name={cfg.env.name} is not "
                              "supported yet: unset one of them")
        if cfg.rollout.agent_mode == "proxy":
            return None
        return EnvEpisodes(self.services) if cfg.env.name else SingleTurn(self.services)

    def env_threads(self) -> dict[str, int] | None:
        """The environment's thread pool's load (multi-turn only; rollout/env_threads.py)."""
        return self.mode.threads.load() if isinstance(self.mode, EnvEpisodes) else None

    def proxy(self) -> AgentProxy:
        """rollout.agent_mode=proxy: the sessions external agents drive, on our services."""
        from relax_slurm.rollout.proxy import AgentProxy

        return AgentProxy(self.services)

    async def wait_for_engines(self) -> None:
        """The launcher starts every role at once: engines may still be loading their models."""
        urls = self.services.engine_urls() + ([self.judge_url] if self.judge_url else [])
        log.info("waiting for the engines' /health: %s", " ".join(urls))

        def stop_requested() -> None:  # in the wait's thread, which a cancel cannot stop
            if self.stop.is_set():
                raise StopRequested
        try:
            await asyncio.to_thread(wait_until_healthy, urls, self.cfg.rollout.startup_timeout_s,
                                    between_polls=stop_requested)
        except StopRequested:
            pass

    def start_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        task = asyncio.create_task(self.guarded_group(prompt, gid, data_state))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    async def guarded_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        """A group whose engine went away (died, restarting in place) or aborted it for good (a
        weight sync with weight_sync.pause_mode=abort and rollout.partial_rollout=false, or a
        multi-turn episode) is queued again with its credit and the same seeds; any other
        failure fails the worker."""
        try:
            await self.mode.rollout_group(prompt, gid, data_state)
        except (EngineUnreachable, EngineAborted) as e:
            log.warning("group %d re-queued: %s", gid, e)
            if isinstance(e, EngineUnreachable):  # no busy loop while the engine restarts
                await asyncio.sleep(ENGINE_RETRY_S)
            self.requeued.append((prompt, gid, data_state))
            self.requeued_total += 1

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failed is None:
            self.failed = task.exception()
            self.stop.set()

    async def rejoin(self) -> None:
        """A restarted worker (the launcher restarts a dead one in place) gets back the credits
        its predecessor held and continues after that one's newest accepted group; a first
        start finds nothing to take over."""
        joined = await self.services.broker.rejoin(self.worker_rank)
        pos = (None if joined.get("position") is None
               else DataPosition.from_dict(joined["position"], "the broker's rejoin position"))
        if pos is not None and pos.next_group_id > self.services.group_ids.first:
            if self.dataset is not None:  # proxy mode has no data position
                self.dataset.load_state_dict(pos.data_state)
            self.services.group_ids.restart_at(pos.next_group_id)
            log.info("rejoined: %d credits reclaimed; continuing at data position %s, group "
                     "id %d", joined["reclaimed"], pos.data_state, pos.next_group_id)

    def requests_per_engine(self) -> dict[str, int]:
        router = self.services.router
        return {e.url: n for e, n in zip(router.engines, router.picked)}

    def requests_open(self) -> dict[str, int]:
        """Requests in flight per engine now (a stall note names the busy engines)."""
        router = self.services.router
        return {e.url: n for e, n in zip(router.engines, router.inflight)}

    async def follow_engines(self) -> None:
        """Elastic rollout (broker/elastic.py): route to the broker's active engines only. A new
        one is active once it holds the current weights; a draining one gets no new request,
        and once none of ours is in flight there the broker hears it is drained."""
        svc = self.services
        view = await svc.broker.engines()
        if not view["engines"]:  # a broker without the launch's plan knows none: keep ours
            return
        for _ in range(2):  # a second turn reports the engines the first one found drained
            routable = set(view["routable"])
            known = {e.url for e in svc.router.engines}
            for url in view["routable"]:
                if url not in known:
                    log.info("engine %s joined: routing to it", url)
                    svc.router.add(svc.engine(url))
            svc.router.route_only(lambda e: e.url in routable)
            draining = {e["url"] for e in view["engines"] if e["state"] == "draining"}
            drained = [e.url for e in svc.router.idle_unroutable() if e.url in draining]
            if not drained:
                return
            log.info("engine(s) %s drained", drained)
            view = await svc.broker.engines(drained=drained)

    async def run(self) -> None:
        limit = self.cfg.rollout.max_inflight_groups
        broker = self.services.broker
        await self.services.reward_pool.start()  # a reward worker that cannot start fails now
        await self.rejoin()
        beat = Pacer(self.cfg.cluster.restart.heartbeat_interval_s)
        while not self.stop.is_set():
            if beat.due():  # from this loop, not a thread: a beat means the loop turns
                await broker.heartbeat(self.role, groups_in_flight=len(self.tasks),
                                       groups_requeued=self.requeued_total,
                                       requests_per_engine=self.requests_per_engine(),
                                       requests_open=self.requests_open(),
                                       groups_by_phase=self.services.phases.snapshot(),
                                       reward_workers=self.services.reward_pool.load(),
                                       env_threads=self.env_threads())
                await self.follow_engines()
            while self.requeued and len(self.tasks) < limit:  # they still hold their credits
                self.start_group(*self.requeued.popleft())
            room = limit - len(self.tasks)
            if room <= 0:
                await asyncio.wait(self.tasks, timeout=beat.interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                continue
            await self.admit(await broker.acquire(room, wait_s=ACQUIRE_WAIT_S))
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.failed is not None:
            raise self.failed

    async def admit(self, granted: int) -> None:
        """One group per credit granted, each on the next prompt."""
        for i in range(granted):
            prompt = next(self.dataset, None)
            if prompt is None:  # data exhausted (data.num_epochs): hand back the credits
                await self.services.broker.release(granted - i)
                log.info("prompt data exhausted after data.num_epochs=%d", self.cfg.data.num_epochs)
                self.stop.set()
                return
            # the position after this prompt: where a resume continues once it is trained
            self.start_group(prompt, next(self.services.group_ids), self.dataset.state_dict())

    async def aclose(self) -> None:
        """Cancel the requests still open on the engines, then close every connection."""
        await self.services.aclose()
        if self.mode is not None:
            self.mode.close()


async def _amain(run_dir: Path) -> None:
    cfg = load_config(run_dir / "config.yaml")
    worker = RolloutWorker(cfg, run_dir)
    freeze_heap()
    loop = asyncio.get_running_loop()
    work = asyncio.create_task(_serve(worker))

    def on_stop_signal() -> None:
        # The loop stops by itself at its next turn, but a turn may be parked in a call to a
        # broker or engine that died with the run (a launcher killed outright takes every role
        # with it at once): such a call only gives up after broker.request_timeout_s. Past
        # the grace the work is cancelled, so the worker never outlives its run.
        worker.stop.set()
        loop.call_later(STOP_GRACE_S, work.cancel)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal)
    try:
        await work
    except asyncio.CancelledError:
        if not work.cancelled():
            raise
        log.info("stopping: still busy %.0f s after the stop signal; its calls cancelled",
                 STOP_GRACE_S)
    except BrokerShutdown as e:  # the run is ending: not an error worth a traceback
        log.info("stopping: %s", e)
    finally:
        await worker.aclose()


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived while the worker waited for its engines."""


async def _serve(worker: RolloutWorker) -> None:
    await worker.wait_for_engines()
    if worker.stop.is_set():
        return
    if worker.proxy_url:  # rollout.agent_mode=proxy: external agents drive the sessions
        url = urlparse(worker.proxy_url)  # bound at the address agents use, as the broker
        await worker.rejoin()  # a restarted worker frees its predecessor's credits (its
        # sessions are gone with it) and continues its group ids
        # (imported here: FastAPI costs every other run's worker ~0.5 CPU-s at start)
        from relax_slurm.rollout.proxy_server import serve_proxy

        await serve_proxy(worker.proxy(), worker.stop, worker.role,
                          url.hostname or "127.0.0.1", int(url.port or 0))
    else:
        await worker.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    register_stack_dumps(args.run_dir, "rollout")  # its stacks on SIGUSR2 (relax-ctl dump)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(message)s")
    asyncio.run(_amain(args.run_dir))
    exit_now(0)  # the reward pool and sockets are closed; skip the interpreter's teardown


if __name__ == "__main__":
    main()
