"""Multi-turn rollout (env.name set): n episodes of the environment per admitted prompt, every
turn of the group on one engine (its prefix cache holds the shared prompt and each episode's
history); the episodes go to the broker as one group (`RolloutServices.put_episodes`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from relax_slurm.data import Prompt
from relax_slurm.envs import env_factory
from relax_slurm.rewards import RewardInput
from relax_slurm.engines.client import GenerateResult, raise_if_aborted
from relax_slurm.rollout.env_threads import EnvThreads
from relax_slurm.rollout.multiturn import Episode, ObservationRenderer, TurnLimits, run_episode
from relax_slurm.rollout.services import RolloutServices


class EnvEpisodes:
    """The multi-turn mode of the rollout worker: `rollout_group` per admitted prompt."""

    def __init__(self, svc: RolloutServices) -> None:
        self.svc = svc
        self.make_env: Callable = env_factory(svc.cfg.env.name, svc.cfg.env.kwargs)
        self.renderer = ObservationRenderer(svc.tokenizer, svc.cfg.data.apply_chat_template)
        self.limits = TurnLimits.of(svc.cfg)
        # a blocking environment's plain reset/step/close (envs/base.py), off the event loop
        self.threads = EnvThreads(svc.cfg.env.threads)

    async def rollout_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        t_start = time.time()
        params = self.svc.group_params(gid)
        with self.svc.phases("episodes"):
            episodes = await self.episodes(prompt, params)
        t_end = time.time()
        rewards, errors = await self.episode_rewards(prompt, episodes)
        await self.svc.put_episodes(prompt.prompt_id, gid, episodes, rewards, errors,
                                    {"t_start": t_start, "t_end": t_end,
                                     "t_scored": time.time(), "data_state": data_state})

    async def episodes(self, prompt: Prompt, params: list[dict]) -> list[Episode]:
        """The group's episodes, each turn of each on the one engine picked for the group."""
        async with self.svc.router.pick() as engine:
            async def generate(ids: list[int], p: dict, routed_start: int) -> GenerateResult:
                with self.svc.phases("turns"):  # the rest of an episode's time: the env's
                    [res] = raise_if_aborted(await engine.generate([ids], [p],
                                                                   routed_start=routed_start),
                                             engine.url)
                return res

            return await asyncio.gather(*(
                run_episode(generate, self.make_env(), prompt, prompt.input_ids, self.renderer,
                            self.limits, p, self.svc.decode, self.threads) for p in params))

    async def episode_rewards(self, prompt: Prompt, episodes: list[Episode]
                              ) -> tuple[list[float], int]:
        """env.reward_source=env: each episode's own (shaped) reward; reward_fn: the reward
        function on the last model turn (the final answer), plus the env's turn shaping."""
        coef = self.svc.cfg.env.turn_reward_coef
        if self.svc.cfg.env.reward_source == "env":
            return [ep.reward(coef) for ep in episodes], 0
        inputs = [RewardInput(prompt=prompt.text, label=prompt.label, metadata=prompt.metadata,
                              response=ep.last_turn_text, finish_reason=ep.finish_reason)
                  for ep in episodes]
        scored = await self.svc.score_many(inputs)
        rewards = [value + coef * sum(ep.turn_rewards[:-1])
                   for (value, _), ep in zip(scored, episodes)]
        return rewards, sum(error for _, error in scored)

    def close(self) -> None:
        self.threads.close()
