"""Rollout worker: prompts -> engines -> rewards (+ teacher) -> groups -> broker.

With rollout.agent_mode=proxy it serves the OpenAI-compatible proxy instead (rollout/proxy.py):
external agent programs drive the conversations and give the rewards; the groups go to the
broker the same way.

`python -m relax_slurm.rollout --run-dir DIR` (see rollout/__main__.py). One asyncio loop drives
many prompt groups at once: it asks the broker for admission credits (which is what bounds
staleness), starts one task per admitted prompt, and each task samples `n_samples_per_prompt`
responses from one engine (tasks started together share one batched request, see
rollout/coalesce.py), scores them in the reward pool (worker processes with a timeout),
asks the teacher engine for their log-probs when the run has one (on-policy distillation) and
puts the group on the broker. The worker cannot tell an SGLang server from the hf engine: both
speak the same HTTP protocol. A sequence a weight sync aborts (weight_sync.pause_mode=abort)
is continued from its prefix on the new weights (rollout/partial.py, rollout.partial_rollout).

Data-side algorithm knobs applied here (pure functions in relax_slurm/rewards/shaping.py):
- `algo.overlong_buffer_tokens`: the soft overlong penalty is added to each reward;
- `algo.dynamic_sampling`: a group whose (penalised) rewards are all equal is not put on the
  broker; its credit is released, so the loop admits and samples another prompt instead.
Events of groups that never reach the broker (filtered groups, their reward errors) ride in the
metadata of the next group that does, so the trainer's metrics count them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from relax_slurm.broker.client import AsyncBrokerClient
from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.data import Prompt, PromptDataset, load_tokenizer
from relax_slurm.data.processor import MediaLimits, MediaProcessor, Processed
from relax_slurm.envs import env_factory
from relax_slurm.errors import BrokerShutdown, ConfigError, EngineAborted, EngineUnreachable
from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.runtime.plan import load_plan
from relax_slurm.rewards import RewardInput, RewardPool, build_reward
from relax_slurm.rewards.shaping import is_informative_group, overlong_penalty
from relax_slurm.engines import sglang_api
from relax_slurm.rollout.coalesce import CoalescingEngine
from relax_slurm.engines.client import (
    AsyncEngineClient, GenerateResult, raise_if_aborted, wait_until_healthy,
)
from relax_slurm.rollout.multiturn import (
    Episode, ObservationRenderer, TurnLimits, episode_sample, run_episode,
)
from relax_slurm.rollout.partial import generate_resuming, version_record
from relax_slurm.rollout.proxy_server import serve_proxy
from relax_slurm.rollout.router import LeastLoadedRouter
from relax_slurm.routing.shape import RoutingShape, decode_routed_experts, routing_shape
from relax_slurm.samples import Group, Sample

log = logging.getLogger("relax_slurm.rollout")
ENGINE_RETRY_S = 2.0  # a group whose engine is unreachable waits this long before its retry
ACQUIRE_WAIT_S = 2.0  # one parked admission request; short so shutdown is noticed promptly
STOP_GRACE_S = 8.0  # after SIGTERM: more than the proxy's own shutdown grace (5 s), less than
# the launcher's before it SIGKILLs (launch/processes.py TERM_GRACE_S, 10 s)


def sample_seed(run_seed: int, group_id: int, index: int, n: int) -> int:
    """SGLang `sampling_seed` of one sample: a pure function of (run seed, group, index), so a
    resumed run draws exactly the tokens the uninterrupted run would have drawn."""
    return (run_seed << 40) + group_id * n + index


def resume_state(resume_from: str | None, worker_rank: int) -> tuple[dict | None, int]:
    """Data position and next group id saved in a checkpoint's meta.json (JSON, no torch)."""
    if not resume_from:
        return None, worker_rank
    extra = json.loads((Path(resume_from) / "meta.json").read_text())["extra_state"]
    rollout = extra.get("rollout", {}).get(str(worker_rank), {})
    return rollout.get("data_state"), int(rollout.get("next_group_id", worker_rank))


@dataclass
class PendingCounts:
    """Counts of groups that did not reach the broker, handed to the next group that does."""

    reward_errors: int = 0
    filtered_groups: int = 0

    def take(self, reward_errors: int) -> dict[str, int]:
        """This group's counts plus everything pending (then reset): its samples' metadata."""
        out = {"reward_errors": self.reward_errors + reward_errors,
               "filtered_groups": self.filtered_groups}
        self.reward_errors = self.filtered_groups = 0
        return out


def shaped_rewards(cfg: TrainConfig, rewards: list[float], lengths: list[int]) -> list[float]:
    """Rewards with the soft overlong penalty added (algo.overlong_buffer_tokens, 0 = off)."""
    a = cfg.algo
    return [r + overlong_penalty(n, cfg.rollout.max_new_tokens, a.overlong_buffer_tokens,
                                 a.overlong_penalty_factor)
            for r, n in zip(rewards, lengths)]


def cut_at_media_pads(res: GenerateResult, pad_ids: Iterable[int]) -> GenerateResult:
    """A response cut before its first media pad token, finish reason "length" (the trainer's
    forward would read a pad as a media slot). The hf engine never samples them; an SGLang
    engine serving a barely trained model may.

    >>> r = cut_at_media_pads(GenerateResult([5, 9, 6], [-1.0, -2.0, -3.0], "stop", "0"), [9])
    >>> r.output_ids, r.logprobs, r.finish_reason
    ([5], [-1.0], 'length')
    """
    pads = set(pad_ids)
    cut = next((i for i, t in enumerate(res.output_ids) if t in pads), None)
    if cut is None:
        return res
    return dataclasses.replace(res, output_ids=res.output_ids[:cut],
                               logprobs=res.logprobs[:cut], finish_reason="length")


def grades_like_math(reward_name: str) -> bool:
    """Whether the reward uses math-verify, worth pre-loading in the pool (seconds of SymPy
    imports, which would otherwise count against the first call's timeout)."""
    return any(k in reward_name for k in ("math", "dapo", "deepscaler", "openr1mm"))


def response_logprobs(prefill: list[float], prompt_len: int,
                      mask: list[float] | None = None) -> np.ndarray:
    """A prefill's log-probs of the response tokens, [R] float32: token t of the sequence is
    predicted at position t - 1, so the response starts at prompt_len - 1; positions whose mask
    is 0 (environment tokens of a multi-turn response) get 0.

    >>> response_logprobs([-1.0, -2.0, -3.0, -4.0], 2, [1, 0, 1]).tolist()
    [-2.0, 0.0, -4.0]
    """
    out = np.asarray(prefill[prompt_len - 1:], dtype=np.float32)
    if mask is not None:
        out[np.asarray(mask) == 0] = 0.0
    return out


def check_same_tokenizer(tokenizer, teacher_path: str, model_path: str) -> None:
    """The teacher is sent the student's token ids: it must read them as the same text."""
    if load_tokenizer(teacher_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"algo.teacher_model_path={teacher_path} has another tokenizer than model.path="
            f"{model_path}: on-policy distillation sends token ids, so the teacher needs the "
            "same vocabulary")


def sampling_params(cfg: TrainConfig) -> dict:
    r = cfg.rollout
    return {
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
    }


def sample_routing(res: GenerateResult, prompt_len: int, shape: RoutingShape, *,
                   required: bool) -> np.ndarray | None:
    """A response's routed experts as a sample carries them (flat int16, one row per prompt +
    response token but the last), or None when the engine sent none; `required`
    (algo.routing_replay) makes that a ConfigError naming the engine flag."""
    if res.routed_experts is None:
        if required:
            raise ConfigError(
                "algo.routing_replay=true but the engine returned no meta_info.routed_experts: "
                f"start SGLang with {sglang_api.ROUTED_EXPERTS_FLAG} (relax-train adds it to the "
                "engines it starts for an MoE model.path; check externally started engines)")
        return None
    # decoded for every token generated; a response cut short here (at a media pad) drops the
    # rows of the tokens it lost
    generated = int(res.meta_info.get("completion_tokens", len(res.output_ids)))
    ids = decode_routed_experts(res.routed_experts, shape, prompt_len + generated - 1)
    return ids[:(prompt_len + len(res.output_ids) - 1) * shape.layers * shape.topk]


class RolloutWorker:
    def __init__(self, cfg: TrainConfig, run_dir: Path, worker_rank: int = 0, num_workers: int = 1):
        plan = load_plan(run_dir)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.proxy_url = plan.proxy_url  # rollout.agent_mode=proxy: external agents drive
        if (cfg.rollout.agent_mode == "proxy") != bool(self.proxy_url):
            raise ConfigError(f"rollout.agent_mode={cfg.rollout.agent_mode} but the run plan "
                              f"has proxy_url={self.proxy_url}: start the run with relax-train")
        # the proxy's sessions come from external agents, not from the dataset
        self.dataset = (PromptDataset(cfg.data, self.tokenizer) if cfg.rollout.agent_mode == "env"
                        else None)
        data_state, first_group_id = resume_state(plan.resume_from, worker_rank)
        if data_state is not None and self.dataset is not None:
            self.dataset.load_state_dict(data_state)
            log.info("resumed data position %s, next group id %d", data_state, first_group_id)
        # a bad reward config fails here, at start; a managed judge's URL comes from the plan
        self.reward = build_reward(plan.reward_config(cfg.reward))
        self.judge_url = plan.genrm_url
        self.reward_pool = RewardPool(cfg.reward.num_workers, cfg.reward.timeout_s,
                                      warm_up=grades_like_math(cfg.reward.name))
        self.counts = PendingCounts()
        self.broker = AsyncBrokerClient(
            plan.broker_router, cfg.broker.request_timeout_s, identity=f"rollout{worker_rank}"
        )
        # an MoE policy's engines report where they routed each token (routing replay)
        self.routing = (routing_shape(cfg.model.path) if cfg.rollout.return_routed_experts
                        else None)
        self.router = LeastLoadedRouter(
            [CoalescingEngine(self._engine_client(u), cfg.rollout.groups_per_request)
             for u in plan.engine_urls]
        )
        if cfg.algo.teacher_model_path and plan.teacher_url is None:
            raise ConfigError(
                f"algo.teacher_model_path={cfg.algo.teacher_model_path} is set but this run has "
                "no teacher engine in its plan (relax-train starts one, locally and on Slurm): "
                "start the run with relax-train, or unset it")
        self.teacher = None
        if plan.teacher_url:
            check_same_tokenizer(self.tokenizer, cfg.algo.teacher_model_path, cfg.model.path)
            self.teacher = AsyncEngineClient(plan.teacher_url, cfg.rollout.request_timeout_s)
        self.params = sampling_params(cfg)
        self.media, self.media_pool = self._media_processing(cfg)
        self.make_env = None  # multi-turn rollouts: one environment per episode
        if cfg.env.name:
            self.make_env = env_factory(cfg.env.name, cfg.env.kwargs)  # a bad env fails now
        if cfg.env.name or cfg.rollout.agent_mode == "proxy":
            self.renderer = ObservationRenderer(self.tokenizer, cfg.data.apply_chat_template)
            self.limits = TurnLimits(cfg.env.max_turns, cfg.env.max_total_tokens,
                                     cfg.rollout.max_new_tokens)
        # group ids unique across workers without coordination
        self.worker_rank = worker_rank
        self.role = "rollout" if worker_rank == 0 else f"rollout{worker_rank}"
        self.group_ids = itertools.count(first_group_id, num_workers)
        self.first_group_id, self.num_workers = first_group_id, num_workers
        self.stop = asyncio.Event()
        self.failed: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self.requeued: deque[tuple[Prompt, int, dict]] = deque()
        self.requeued_total = 0
        self.warned_no_routing = False

    def _engine_client(self, url: str) -> AsyncEngineClient:
        return AsyncEngineClient(url, self.cfg.rollout.request_timeout_s,
                                 routed_experts=self.routing is not None)

    def routed_experts(self, prompt_ids: list[int], res: GenerateResult) -> np.ndarray | None:
        """The sample's routed experts (None for a dense model, or, with a warning, from an
        engine that does not report them while nothing needs them)."""
        if self.routing is None:
            return None
        ids = sample_routing(res, len(prompt_ids), self.routing,
                             required=self.cfg.algo.routing_replay)
        if ids is None and not self.warned_no_routing:
            log.warning("the engines return no routed experts (start SGLang with %s): no "
                        "routing replay, no train/routing_mismatch_frac",
                        sglang_api.ROUTED_EXPERTS_FLAG)
            self.warned_no_routing = True
        return ids

    def _media_processing(self, cfg: TrainConfig
                          ) -> tuple[MediaProcessor | None, concurrent.futures.Executor | None]:
        """Multimodal data: the model's processors and the threads that run them."""
        d = cfg.data
        if not d.multimodal_keys:
            return None, None
        if cfg.env.name:
            raise ConfigError(f"data.multimodal_keys with env.name={cfg.env.name} is not "
                              "supported yet: unset one of them")
        processor = MediaProcessor(cfg.model.path, self.tokenizer.get_vocab(),
                                   MediaLimits.of(d))
        return (processor, concurrent.futures.ThreadPoolExecutor(d.media_num_workers,
                                                                 thread_name_prefix="media"))

    async def processed(self, prompt: Prompt) -> Processed:
        """The prompt's ids with media pads expanded and its media tensors (text: as is)."""
        if self.media is None or not any(prompt.media.values()):
            return Processed(input_ids=list(prompt.input_ids))
        return await asyncio.get_running_loop().run_in_executor(
            self.media_pool, self.media.process, prompt.input_ids, prompt.media,
            f"prompt {prompt.prompt_id}")

    async def score(self, prompt: Prompt, results: list[GenerateResult]
                    ) -> tuple[list[float], int]:
        """Every response's reward from the pool; (rewards, number of errors)."""
        inputs = [RewardInput(prompt=prompt.text, label=prompt.label, metadata=prompt.metadata,
                              response=self.tokenizer.decode(r.output_ids,
                                                             skip_special_tokens=True),
                              finish_reason=r.finish_reason) for r in results]
        scored = await self.reward_pool.score_many(self.reward, inputs)  # one message per group
        return [value for value, _ in scored], sum(error for _, error in scored)

    async def teacher_logprobs(self, prompt_ids: list[list[int]], responses: list[list[int]],
                               masks: list[list[float]] | None = None,
                               media: list[dict] | None = None) -> list[np.ndarray | None]:
        """The teacher's log-prob of each response token given prompt + response so far, from
        the prefill path of its /generate (with the prompt's media for multimodal samples);
        [None] * n without a teacher. `masks`: multi-turn responses hold environment tokens
        (mask 0), which the teacher scores too but which get 0 here: only model tokens train."""
        if self.teacher is None:
            return [None] * len(responses)
        seqs = [list(p) + list(r) for p, r in zip(prompt_ids, responses)]
        # at temperature 1: the teacher's own distribution
        lps = await self.teacher.prefill_logprobs(seqs, media=media)
        return [response_logprobs(lp, len(p), None if masks is None else masks[i])
                for i, (lp, p) in enumerate(zip(lps, prompt_ids))]

    async def rollout_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        n = self.cfg.rollout.n_samples_per_prompt
        params = [{**self.params, "sampling_seed": sample_seed(self.cfg.seed, gid, i, n)}
                  for i in range(n)]
        t_start = time.time()
        if self.make_env is not None:
            await self.rollout_episodes(prompt, gid, data_state, params, t_start)
            return
        processed = await self.processed(prompt)
        media = ([{k: [r.to_engine() for r in refs] for k, refs in prompt.media.items()}] * n
                 if processed.tensors else None)
        async with self.router.pick() as engine:
            # a sequence a weight sync aborts continues from its prefix (rollout.partial_rollout)
            results = await generate_resuming(engine.generate, [processed.input_ids] * n,
                                              params, media, url=engine.url,
                                              resume=self.cfg.rollout.partial_rollout)
        if processed.tensors:
            results = [cut_at_media_pads(r, self.media.pad_ids.values()) for r in results]
        t_end = time.time()
        (rewards, errors), teacher = await asyncio.gather(
            self.score(prompt, results),
            self.teacher_logprobs([processed.input_ids] * n, [r.output_ids for r in results],
                                  media=media))
        rewards = shaped_rewards(self.cfg, rewards, [len(r.output_ids) for r in results])
        counts = await self.counts_or_filter(rewards, errors)
        if counts is None:
            return
        group: Group = []
        for res, reward, teacher_lp in zip(results, rewards, teacher):
            # tokens from several versions when a sync paused the engine mid-way (retract, or
            # abort and resumed): the staleness rule judges the oldest
            spans = version_record(res)
            versions = [v for v, _, _ in spans] or res.versions() or [0]
            group.append(Sample(
                prompt_id=prompt.prompt_id, group_id=gid,
                prompt_ids=processed.input_ids, response_ids=res.output_ids,
                loss_mask=[1.0] * len(res.output_ids), rollout_logprobs=res.logprobs,
                teacher_logprobs=teacher_lp,
                routed_experts=self.routed_experts(processed.input_ids, res),
                mm_inputs=processed.tensors,  # one dict: the group's samples share its arrays
                reward=float(reward), version=max(versions), version_min=min(versions),
                version_spans=spans, finish_reason=res.finish_reason,
                metadata={"t_start": t_start, "t_end": t_end, "worker": self.worker_rank,
                          "data_state": data_state, **counts},
            ))
        await self.broker.put_group(group)

    async def counts_or_filter(self, rewards: list[float], errors: int) -> dict | None:
        """The counts for this group's samples' metadata; None when dynamic sampling drops it
        (all advantages would be 0: the credit goes back and the loop admits another prompt)."""
        if self.cfg.algo.dynamic_sampling and not is_informative_group(rewards):
            self.counts.filtered_groups += 1
            self.counts.reward_errors += errors
            await self.broker.release(1)
            return None
        return self.counts.take(errors)

    async def rollout_episodes(self, prompt: Prompt, gid: int, data_state: dict,
                               params: list[dict], t_start: float) -> None:
        """Multi-turn: n episodes of the environment, every turn of the group on one engine
        (its prefix cache holds the shared prompt and each episode's history)."""
        async with self.router.pick() as engine:
            async def generate(ids: list[int], p: dict) -> GenerateResult:
                [res] = raise_if_aborted(await engine.generate([ids], [p]), engine.url)
                return res

            episodes = await asyncio.gather(*(
                run_episode(generate, self.make_env(), prompt, prompt.input_ids, self.renderer,
                            self.limits, p, self._decode) for p in params))
        t_end = time.time()
        rewards, errors = await self.episode_rewards(prompt, episodes)
        await self.put_episodes(prompt.prompt_id, gid, episodes, rewards, errors,
                                {"t_start": t_start, "t_end": t_end, "data_state": data_state})

    async def put_episodes(self, prompt_id: str, gid: int, episodes: list[Episode],
                           rewards: list[float], errors: int, metadata: dict) -> bool:
        """Episodes scored `rewards` -> one group on the broker (after the overlong penalty and
        dynamic sampling, which may drop it: False). Shared by the env-driven episodes and the
        proxy's sessions."""
        rewards = shaped_rewards(self.cfg, rewards, [len(e.response_ids) for e in episodes])
        counts = await self.counts_or_filter(rewards, errors)
        if counts is None:
            return False
        meta = {**metadata, "worker": self.worker_rank, **counts}
        if self.teacher is not None and any(ep.images for ep in episodes):
            raise ConfigError("on-policy distillation of episodes with image observations is "
                              "not supported yet (the teacher would need their images): unset "
                              "algo.teacher_model_path or use a text environment")
        teacher = await self.teacher_logprobs([ep.prompt_ids for ep in episodes],
                                              [ep.response_ids for ep in episodes],
                                              masks=[ep.loss_mask for ep in episodes])
        await self.broker.put_group([episode_sample(ep, prompt_id=prompt_id, group_id=gid,
                                                    reward=r, metadata=meta, teacher_logprobs=lp)
                                     for ep, r, lp in zip(episodes, rewards, teacher)])
        return True

    async def episode_rewards(self, prompt: Prompt, episodes: list[Episode]
                              ) -> tuple[list[float], int]:
        """env.reward_source=env: each episode's own (shaped) reward; reward_fn: the reward
        function on the last model turn (the final answer), plus the env's turn shaping."""
        coef = self.cfg.env.turn_reward_coef
        if self.cfg.env.reward_source == "env":
            return [ep.reward(coef) for ep in episodes], 0
        inputs = [RewardInput(prompt=prompt.text, label=prompt.label, metadata=prompt.metadata,
                              response=ep.last_turn_text, finish_reason=ep.finish_reason)
                  for ep in episodes]
        scored = await self.reward_pool.score_many(self.reward, inputs)
        rewards = [value + coef * sum(ep.turn_rewards[:-1])
                   for (value, _), ep in zip(scored, episodes)]
        return rewards, sum(error for _, error in scored)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def wait_for_engines(self) -> None:
        """The launcher starts every role at once: engines may still be loading their models."""
        urls = [e.url for e in self.router.engines] + ([self.teacher.url] if self.teacher else [])
        urls += [self.judge_url] if self.judge_url else []  # the managed judge (genrm rewards)
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
            await self.rollout_group(prompt, gid, data_state)
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
        joined = await self.broker.rejoin(self.worker_rank)
        pos = joined.get("position")
        if pos and pos["next_group_id"] > self.first_group_id:
            if self.dataset is not None:  # proxy mode has no data position
                self.dataset.load_state_dict(pos["data_state"])
            self.group_ids = itertools.count(pos["next_group_id"], self.num_workers)
            log.info("rejoined: %d credits reclaimed; continuing at data position %s, group "
                     "id %d", joined["reclaimed"], pos["data_state"], pos["next_group_id"])

    def requests_per_engine(self) -> dict[str, int]:
        return {e.url: n for e, n in zip(self.router.engines, self.router.picked)}

    async def follow_engines(self) -> None:
        """Elastic rollout (broker/elastic.py): route to the broker's active engines only. A new
        one is active once it holds the current weights; a draining one gets no new request,
        and once none of ours is in flight there the broker hears it is drained."""
        view = await self.broker.engines()
        if not view["engines"]:  # a broker without the launch's plan knows none: keep ours
            return
        for _ in range(2):  # a second turn reports the engines the first one found drained
            routable = set(view["routable"])
            known = {e.url for e in self.router.engines}
            for url in view["routable"]:
                if url not in known:
                    log.info("engine %s joined: routing to it", url)
                    self.router.add(CoalescingEngine(
                        self._engine_client(url),
                        self.cfg.rollout.groups_per_request))
            self.router.route_only(lambda e: e.url in routable)
            draining = {e["url"] for e in view["engines"] if e["state"] == "draining"}
            drained = [e.url for e in self.router.idle_unroutable() if e.url in draining]
            if not drained:
                return
            log.info("engine(s) %s drained", drained)
            view = await self.broker.engines(drained=drained)

    async def run(self) -> None:
        limit = self.cfg.rollout.max_inflight_groups
        await self.reward_pool.start()  # a reward worker that cannot start fails the run now
        await self.rejoin()
        beat = Pacer(self.cfg.cluster.heartbeat_interval_s)
        while not self.stop.is_set():
            if beat.due():  # from this loop, not a thread: a beat means the loop turns
                await self.broker.heartbeat(self.role, groups_in_flight=len(self.tasks),
                                            groups_requeued=self.requeued_total,
                                            requests_per_engine=self.requests_per_engine())
                await self.follow_engines()
            while self.requeued and len(self.tasks) < limit:  # they still hold their credits
                self.start_group(*self.requeued.popleft())
            room = limit - len(self.tasks)
            if room <= 0:
                await asyncio.wait(self.tasks, timeout=beat.interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                continue
            granted = await self.broker.acquire(room, wait_s=ACQUIRE_WAIT_S)
            for i in range(granted):
                prompt = next(self.dataset, None)
                if prompt is None:  # data exhausted (data.num_epochs): hand back the credits
                    await self.broker.release(granted - i)
                    log.info("prompt data exhausted after data.num_epochs=%d", self.cfg.data.num_epochs)
                    self.stop.set()
                    break
                # the position after this prompt: where a resume continues once it is trained
                self.start_group(prompt, next(self.group_ids), self.dataset.state_dict())
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.failed is not None:
            raise self.failed

    async def aclose(self) -> None:
        """Cancel the requests still open on the engines, then close every connection."""
        for engine in [*self.router.engines, *([self.teacher] if self.teacher else [])]:
            await engine.aclose()
        self.reward_pool.close()
        self.broker.close()
        if self.media_pool is not None:
            self.media_pool.shutdown(wait=False, cancel_futures=True)


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
        await serve_proxy(worker, url.hostname or "127.0.0.1", int(url.port or 0))
    else:
        await worker.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(message)s")
    asyncio.run(_amain(args.run_dir))
    exit_now(0)  # the reward pool and sockets are closed; skip the interpreter's teardown


if __name__ == "__main__":
    main()
