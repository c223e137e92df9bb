"""What every rollout mode shares: the broker, the engines' router, the reward, the teacher, the
group ids, and the tail of a group's way (overlong penalty, dynamic sampling, teacher log-probs,
`put_group`).

The rollout worker builds one `RolloutServices` and hands it to its mode (rollout/single_turn.py,
rollout/episodes.py, or the agent proxy, rollout/proxy.py); none of them holds the worker, whose
own part is the admission loop (rollout/worker.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_slurm.broker.client import AsyncBrokerClient
from relax_slurm.config import TrainConfig
from relax_slurm.data import load_tokenizer
from relax_slurm.data.tokenizer import text_decoder
from relax_slurm.errors import ConfigError
from relax_slurm.modeling import model_media_token_ids
from relax_slurm.runtime.plan import RunPlan
from relax_slurm.rewards import RewardPool, build_reward, reward_workers
from relax_slurm.rewards.shaping import is_informative_group
from relax_slurm.engines import sglang_api
from relax_slurm.rollout.coalesce import CoalescingEngine
from relax_slurm.engines.async_client import AsyncEngineClient
from relax_slurm.engines.client import GenerateResult
from relax_slurm.engines.served_adapter import ServedAdapter
from relax_slurm.rollout.multiturn import Episode, episode_sample
from relax_slurm.rollout.phases import Phases
from relax_slurm.rollout.router import LeastLoadedRouter
from relax_slurm.rollout.version_gate import PROBE_TIMEOUT_S, VersionGate
from relax_slurm.rollout.sampling import (
    media_pad_ban, no_routing_error, response_logprobs, sample_routing, sampling_params,
    seeded_params, shaped_rewards,
)
from relax_slurm.routing.segments import sample_rows
from relax_slurm.routing.shape import RoutingShape, routing_shape
from relax_slurm.sample_meta import SampleMeta

log = logging.getLogger("relax_slurm.rollout")


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


class GroupIds:
    """Group ids unique across workers without coordination: start, start + n, start + 2n..."""

    def __init__(self, start: int, num_workers: int) -> None:
        self.first, self.num_workers = start, num_workers
        self._ids = itertools.count(start, num_workers)

    def __next__(self) -> int:
        return next(self._ids)

    def restart_at(self, start: int) -> None:
        """Continue at `start` (a restarted worker, after its predecessor's newest group)."""
        self._ids = itertools.count(start, self.num_workers)


def grades_like_math(reward_name: str) -> bool:
    """Whether the reward uses math-verify, worth pre-loading in the pool (seconds of SymPy
    imports, which would otherwise count against the first call's timeout)."""
    return any(k in reward_name for k in ("math", "dapo", "deepscaler", "openr1mm"))


async def teacher_response_logprobs(teacher: AsyncEngineClient, prompt_ids: list[list[int]],
                                    responses: list[list[int]],
                                    masks: list[list[float]] | None = None,
                                    media: list[dict] | None = None,
                                    sent_prompts: list[list[int]] | None = None,
                                    exclude: Sequence[int] = ()) -> list[np.ndarray]:
    """The teacher's log-prob of each response token given prompt + response so far, from the
    prefill path of its /generate. `masks`: multi-turn responses hold environment tokens (mask
    0), which the teacher scores too but which get 0 here: only model tokens train.

    Multimodal prompts: `prompt_ids` has the media pads expanded (what the trainer sees),
    `sent_prompts` the same prompts with one pad per item, which the teacher gets with `media`
    and expands itself, as a policy engine does for generation: SGLang's Qwen-VL processors
    refuse ids expanded by the caller (HTTP 500). `exclude`: ids the student never samples
    (its media pads), left out of the teacher's softmax as the trainer leaves them out of the
    student's; SGLang and the hf engine normalize over the whole vocabulary."""
    sent = prompt_ids if sent_prompts is None else sent_prompts
    seqs = [list(p) + list(r) for p, r in zip(sent, responses)]
    # at temperature 1: the teacher's own distribution
    lps = await teacher.prefill_logprobs(
        seqs, media=media, lengths=[len(p) + len(r) for p, r in zip(prompt_ids, responses)],
        exclude=exclude)
    return [response_logprobs(lp, len(p), None if masks is None else masks[i])
            for i, (lp, p) in enumerate(zip(lps, prompt_ids))]


def check_same_tokenizer(tokenizer, teacher_path: str, model_path: str) -> None:
    """The teacher is sent the student's token ids: it must read them as the same text."""
    if load_tokenizer(teacher_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"algo.teacher_model_path={teacher_path} has another tokenizer than model.path="
            f"{model_path}: on-policy distillation sends token ids, so the teacher needs the "
            "same vocabulary")


def make_engine(cfg: TrainConfig, url: str, routed_experts: bool,
                gate: VersionGate | None = None) -> CoalescingEngine:
    """An engine to route to (tasks started together share one batched request)."""
    # model.lora's adapter-only sync: the engines serve each version's adapter under its own
    # name; requests name the newest this engine holds (engines/served_adapter.py)
    adapter = ServedAdapter(lambda: announced_version(gate, cfg.algo.max_staleness)) \
        if cfg.adapter_sync else None
    return CoalescingEngine(AsyncEngineClient(url, cfg.rollout.generate_timeout_s,
                                              routed_experts=routed_experts, adapter=adapter),
                            cfg.rollout.groups_per_request, gate)


def announced_version(gate: VersionGate | None, max_staleness: int) -> int | None:
    """The policy version the broker last told this worker of (its floor + max_staleness),
    which every engine of the cohort loaded before the trainer announced it."""
    floor = None if gate is None else gate.floor_of()
    return None if floor is None else floor + max_staleness


def version_gate(timeout_s: float) -> VersionGate:
    """The worker's gate (its floor: the broker client's, once the services exist); an
    engine's version from its /model_info."""
    async def served(url: str) -> str | None:
        async with AsyncEngineClient(url, min(timeout_s, PROBE_TIMEOUT_S)) as client:
            return await client.weight_version()
    return VersionGate(lambda: None, served)


@dataclass
class RolloutServices:
    """The connections and shared steps of one rollout worker, whatever its mode."""

    cfg: TrainConfig
    tokenizer: Any
    broker: AsyncBrokerClient
    router: LeastLoadedRouter
    reward: Any
    reward_pool: RewardPool
    teacher: AsyncEngineClient | None
    routing: RoutingShape | None
    """An MoE policy's engines report where they routed each token (routing replay)."""
    worker_rank: int
    group_ids: GroupIds
    params: dict = field(default_factory=dict)
    """Sampling parameters of every sample (rollout.*), before its seed."""
    counts: PendingCounts = field(default_factory=PendingCounts)
    warned_no_routing: bool = False
    phases: Phases = field(default_factory=Phases)
    """How many groups are in each phase now (the worker's heartbeat: rollout/phases.py)."""
    media_pads: tuple[int, ...] = ()
    """A multimodal model.path's media pads, which the trainer's softmax leaves out: SGLang is
    told never to sample them (in `params`, whatever the data: a VL model on text prompts
    too), and a teacher's log-probs are renormalized without them."""

    def __post_init__(self) -> None:
        self._text = text_decoder(self.tokenizer)

    @classmethod
    def build(cls, cfg: TrainConfig, plan: RunPlan, tokenizer, worker_rank: int,
              group_ids: GroupIds) -> RolloutServices:
        """Connect to what the plan names; a bad reward config or a teacher without its engine
        fails here, at start (a managed judge's URL comes from the plan)."""
        reward = build_reward(plan.reward_config(cfg.reward))
        reward_pool = RewardPool(reward_workers(cfg.reward), cfg.reward.timeout_s,
                                 warm_up=grades_like_math(cfg.reward.name))
        broker = AsyncBrokerClient(plan.broker_router, cfg.broker.request_timeout_s,
                                   identity=f"rollout{worker_rank}",
                                   max_put_bytes=(cfg.broker.max_message_mb << 20) // 2)
        routing = routing_shape(cfg.model.path) if cfg.rollout.return_routed_experts else None
        gate = version_gate(cfg.rollout.generate_timeout_s)
        router = LeastLoadedRouter([make_engine(cfg, u, routing is not None, gate)
                                    for u in plan.engine_urls], gate)
        if cfg.algo.teacher_model_path and plan.teacher_url is None:
            raise ConfigError(
                f"algo.teacher_model_path={cfg.algo.teacher_model_path} is set but this run has "
                "no teacher engine in its plan (relax-train starts one, locally and on Slurm): "
                "start the run with relax-train, or unset it")
        media_pads = model_media_token_ids(cfg.model.path)
        params = sampling_params(cfg)
        if media_pads and cfg.rollout.engine == "sglang":  # the hf engine never samples them
            params |= media_pad_ban(media_pads)
        teacher = None
        if plan.teacher_url:
            check_same_tokenizer(tokenizer, cfg.algo.teacher_model_path, cfg.model.path)
            teacher = AsyncEngineClient(plan.teacher_url, cfg.rollout.generate_timeout_s)
        svc = cls(cfg=cfg, tokenizer=tokenizer, broker=broker, router=router, reward=reward,
                  reward_pool=reward_pool, teacher=teacher, routing=routing,
                  worker_rank=worker_rank, group_ids=group_ids, params=params,
                  media_pads=media_pads)
        # the floor as the worker's broker client last heard it (acquire, put_group)
        gate.floor_of = lambda: getattr(svc.broker, "floor", None)
        return svc

    def engine(self, url: str) -> CoalescingEngine:
        """An engine joining the router (elastic rollout)."""
        return make_engine(self.cfg, url, self.routing is not None, self.router.gate)

    def group_params(self, gid: int) -> list[dict]:
        """The n samples' parameters of group `gid`, each with its own seed."""
        return seeded_params(self.params, self.cfg.seed, gid, self.cfg.rollout.n_samples_per_prompt)

    def decode(self, ids: list[int]) -> str:
        """A response's text (special tokens skipped), as the reward reads it."""
        return self._text(ids)

    def routed_experts(self, prompt_ids: list[int], res: GenerateResult) -> np.ndarray | None:
        """The sample's routed experts (None for a dense model, or, with a warning, from an
        engine that does not report them while nothing needs them)."""
        if self.routing is None:
            return None
        ids = sample_routing(res, len(prompt_ids), self.routing,
                             required=self.cfg.algo.routing_replay)
        if ids is None:
            self._warn_no_routing()
        return ids

    def episode_routing(self, ep: Episode) -> np.ndarray | None:
        """A multi-turn sample's routed experts, assembled from its turns' reports (positions
        none covers are NOT_ROUTED: relax_slurm.routing.segments); None for a dense model."""
        if self.routing is None:
            return None
        if ep.routing.missing and self.cfg.algo.routing_replay:
            raise no_routing_error()  # an engine that ignores the flag, as for single-turn
        ids = sample_rows(ep.routing, ep.prompt_ids + ep.response_ids, self.routing)
        if ids is None:
            self._warn_no_routing()
        return ids

    def _warn_no_routing(self) -> None:
        if not self.warned_no_routing:
            log.warning("the engines return no routed experts (start SGLang with %s): no "
                        "routing replay, no train/routing_mismatch_frac",
                        sglang_api.ROUTED_EXPERTS_FLAG)
            self.warned_no_routing = True

    async def teacher_logprobs(self, prompt_ids: list[list[int]], responses: list[list[int]],
                               masks: list[list[float]] | None = None,
                               media: list[dict] | None = None,
                               sent_prompts: list[list[int]] | None = None
                               ) -> list[np.ndarray | None]:
        """[None] * n without a teacher, else `teacher_response_logprobs` on it."""
        if self.teacher is None:
            return [None] * len(responses)
        with self.phases("teacher"):
            return await teacher_response_logprobs(self.teacher, prompt_ids, responses, masks,
                                                   media, sent_prompts, self.media_pads)

    async def score_many(self, inputs: list) -> list[tuple[float, bool]]:
        """The run's reward of each input, from the reward pool: [(value, error)]."""
        with self.phases("scoring"):
            return await self.reward_pool.score_many(self.reward, inputs)

    async def counts_or_filter(self, rewards: list[float], errors: int) -> dict | None:
        """The counts for this group's samples' metadata; None when dynamic sampling drops it
        (all advantages would be 0: the credit goes back and the loop admits another prompt)."""
        if self.cfg.algo.dynamic_sampling and not is_informative_group(rewards):
            self.counts.filtered_groups += 1
            self.counts.reward_errors += errors
            await self.broker.release(1)
            return None
        return self.counts.take(errors)

    async def put_episodes(self, prompt_id: str, gid: int, episodes: list[Episode],
                           rewards: list[float], errors: int, metadata: dict[str, Any]
                           ) -> bool:
        """Episodes scored `rewards` -> one group on the broker (after the overlong penalty and
        dynamic sampling, which may drop it: False). Shared by the env-driven episodes and the
        proxy's sessions. `metadata`: the `SampleMeta` fields the mode knows (t_start, t_end,
        data_state, agent_group); the worker's rank and the counts are added here."""
        rewards = shaped_rewards(self.cfg, rewards, [len(e.response_ids) for e in episodes])
        counts = await self.counts_or_filter(rewards, errors)
        if counts is None:
            return False
        # a misspelt key of `metadata` is a TypeError here, not a silent extra key on the wire
        meta = SampleMeta(**metadata, worker=self.worker_rank, **counts)
        if self.teacher is not None and any(ep.images for ep in episodes):
            raise ConfigError("on-policy distillation of episodes with image observations is "
                              "not supported yet (the teacher would need their images): unset "
                              "algo.teacher_model_path or use a text environment")
        teacher = await self.teacher_logprobs([ep.prompt_ids for ep in episodes],
                                              [ep.response_ids for ep in episodes],
                                              masks=[ep.loss_mask for ep in episodes])
        group = [episode_sample(ep, prompt_id=prompt_id, group_id=gid, reward=r, metadata=meta,
                                teacher_logprobs=lp, routed_experts=self.episode_routing(ep))
                 for ep, r, lp in zip(episodes, rewards, teacher)]
        with self.phases("sending"):
            await self.broker.put_group(group)
        return True

    def engine_urls(self) -> list[str]:
        """Every engine this worker calls (the teacher too), for the start-up health wait."""
        return [e.url for e in self.router.engines] + ([self.teacher.url] if self.teacher else [])

    async def aclose(self) -> None:
        """Cancel the requests still open on the engines, then close every connection."""
        for engine in [*self.router.engines, *([self.teacher] if self.teacher else [])]:
            await engine.aclose()
        self.reward_pool.close()
        self.broker.close()
