"""Periodic evaluation on the engines: `eval.datasets`, k samples per prompt, mean@k / pass@k.

Started by the trainer's rank 0 right after the engines got a new version (`EvalSchedule`).
In a sync run (max_staleness=0) the rollout worker is idle then (it waits for set_version), so
evaluation runs inline on engines nobody else is using. In an async run it runs in a
background thread, interleaved with rollout on the same engines, while training goes on; its
results land in the row of the step during which it finished, with `policy/eval_version`
naming the version evaluated. Rewards are computed in this process with the run's reward
(eval sets are small).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relax_slurm.config.schema import TrainConfig
from relax_slurm.data import Prompt, PromptDataset, load_tokenizer
from relax_slurm.rewards import RewardInput, build_reward
from relax_slurm.errors import EngineAborted
from relax_slurm.engines.client import EngineClient
from relax_slurm.engines.served_adapter import ServedAdapter

log = logging.getLogger("relax_slurm.eval")
ABORT_RETRIES = 20
"""Times an eval sequence is generated again after a weight sync aborted it (pause_mode=abort)."""
CORRECT = 1.0  # a response counts as solved for pass@k when its reward reaches the full 1.0


def eval_due(every: int, done: int, total: int) -> bool:
    return every > 0 and (done % every == 0 or done == total)


def k_metrics(rewards: list[list[float]], k: int) -> dict[str, float]:
    """Pure: per-prompt rewards of k samples -> mean@k (mean reward) and pass@k (share of
    prompts with at least one correct sample)."""
    n = max(len(rewards), 1)
    return {f"mean@{k}": sum(sum(r) / len(r) for r in rewards) / n,
            f"pass@{k}": sum(any(x >= CORRECT for x in r) for r in rewards) / n}


class Evaluator:
    def __init__(self, cfg: TrainConfig, engine_urls: list[str], reward_cfg: Any = None) -> None:
        """`reward_cfg`: the reward config as the run resolved it (RunPlan.reward_config: a
        managed judge's URL filled in); default cfg.reward."""
        self.cfg = cfg.eval
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.reward = build_reward(reward_cfg or cfg.reward)
        # the policy: with model.lora's adapter-only sync, the adapter of the version each
        # engine serves (engines/served_adapter.py)
        self.engines = [EngineClient(u, cfg.rollout.generate_timeout_s,
                                     adapter=ServedAdapter() if cfg.adapter_sync else None)
                        for u in engine_urls]
        self.params = {"max_new_tokens": cfg.rollout.max_new_tokens,
                       "temperature": self.cfg.temperature,
                       "top_p": cfg.rollout.top_p if self.cfg.temperature > 0 else 1.0,
                       "top_k": cfg.rollout.top_k if self.cfg.temperature > 0 else -1}
        self.sets: dict[str, list[Prompt]] = {}
        for path in self.cfg.datasets:
            data_cfg = dataclasses.replace(cfg.data, train_files=[path], shuffle=False)
            prompts = PromptDataset(data_cfg, self.tokenizer).prompts
            self.sets[Path(path).stem] = prompts[:self.cfg.max_prompts or None]

    def run(self) -> dict[str, float]:
        """Every dataset once; {eval/<stem>/mean@k, eval/<stem>/pass@k, perf/eval_s}."""
        t0 = time.monotonic()
        k, out = self.cfg.n_samples, {}
        for name, prompts in self.sets.items():
            rewards = [self._score(p, rs) for p, rs in zip(prompts, self._generate(prompts, k))]
            out |= {f"eval/{name}/{m}": v for m, v in k_metrics(rewards, k).items()}
        out["perf/eval_s"] = time.monotonic() - t0
        return out

    def _generate(self, prompts: list[Prompt], k: int) -> list[list[Any]]:
        """One batched request per engine, prompts split round-robin."""
        ids = [p.input_ids for p in prompts for _ in range(k)]
        # media as the engine takes them; it expands the one pad per item of these ids
        media = [{kind: [r.to_engine() for r in refs] for kind, refs in p.media.items()}
                 for p in prompts for _ in range(k)]
        seeds = [{**self.params, "sampling_seed": i} for i in range(len(ids))]
        n = len(self.engines)
        results: list[Any] = [None] * len(ids)
        for e, engine in enumerate(self.engines):
            mine = list(range(e, len(ids), n))
            for _ in range(ABORT_RETRIES):  # a weight sync in abort mode ends some: again
                if not mine:
                    break
                got = engine.generate([ids[i] for i in mine], [seeds[i] for i in mine],
                                      media=[media[i] for i in mine] if any(media) else None)
                for i, r in zip(mine, got):
                    results[i] = r
                mine = [i for i, r in zip(mine, got) if r.finish_reason == "abort"]
            if mine:
                raise EngineAborted(f"engine {engine.url}: {len(mine)} eval sequences aborted "
                                    f"{ABORT_RETRIES} times (weight_sync.pause_mode=abort)")
        return [results[i * k:(i + 1) * k] for i in range(len(prompts))]

    def _score(self, prompt: Prompt, results: list[Any]) -> list[float]:
        return [self.reward(RewardInput(
            prompt=prompt.text, label=prompt.label, metadata=prompt.metadata,
            response=self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
            finish_reason=r.finish_reason)) for r in results]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


class EvalSchedule:
    """When evaluation runs and where its metrics go (see the module docstring)."""

    def __init__(self, evaluator: Evaluator, every: int, total_steps: int,
                 background: bool) -> None:
        self.evaluator = evaluator
        self.every, self.total_steps = every, total_steps
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="eval") if background else None
        self.pending: tuple[int, Future] | None = None

    def inline(self, done: int) -> bool:
        """Whether `after_step(done)` evaluates in the caller's thread (a sync run's due eval,
        which must have the engines to itself: the caller announces the version after it)."""
        return self.pool is None and eval_due(self.every, done, self.total_steps)

    def after_step(self, done: int) -> dict[str, float]:
        """Call once the engines serve version `done`; returns metrics for this step's row."""
        out = self._collect(wait=False)
        if eval_due(self.every, done, self.total_steps):
            if self.pool is None:
                out |= self.evaluator.run() | {"policy/eval_version": done}
            elif self.pending is None:
                self.pending = (done, self.pool.submit(self.evaluator.run))
            else:  # the last one is still running: skip rather than queue up behind it
                log.warning("eval of version %d skipped: the eval of version %d is still running",
                            done, self.pending[0])
        if done == self.total_steps:
            out |= self._collect(wait=True)  # the final eval belongs in the final row
        return out

    def _collect(self, wait: bool) -> dict[str, float]:
        if self.pending is None or not (wait or self.pending[1].done()):
            return {}
        version, future = self.pending
        self.pending = None
        return future.result() | {"policy/eval_version": version}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.evaluator.close()
