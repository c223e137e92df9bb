"""Rollout worker: prompts -> engines -> rewards -> groups -> broker.

`python -m relax_slurm.rollout.worker --run-dir DIR`. One asyncio loop drives many prompt
groups at once: it asks the broker for admission credits (which is what bounds staleness),
starts one task per admitted prompt, and each task samples `n_samples_per_prompt` responses
from one engine, scores them and puts the group on the broker. The worker cannot tell an SGLang
server from the hf engine: both speak the same HTTP protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import time
from pathlib import Path

from transformers import AutoTokenizer

from relax_slurm.broker.client import AsyncBrokerClient
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.data import Prompt, PromptDataset
from relax_slurm.launch.plan import load_plan
from relax_slurm.rewards import RewardInput, get_reward_fn
from relax_slurm.rollout.engine_client import AsyncEngineClient
from relax_slurm.rollout.router import LeastLoadedRouter
from relax_slurm.samples import Group, Sample

log = logging.getLogger("relax_slurm.rollout")
ACQUIRE_WAIT_S = 2.0  # one parked admission request; short so shutdown is noticed promptly


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


def sampling_params(cfg: TrainConfig) -> dict:
    r = cfg.rollout
    return {
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
    }


class RolloutWorker:
    def __init__(self, cfg: TrainConfig, run_dir: Path, worker_rank: int = 0, num_workers: int = 1):
        plan = load_plan(run_dir)
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        data_state, first_group_id = resume_state(plan.resume_from, worker_rank)
        if data_state is not None:
            self.dataset.load_state_dict(data_state)
            log.info("resumed data position %s, next group id %d", data_state, first_group_id)
        self.reward_fn = get_reward_fn(cfg.reward.name)
        self.broker = AsyncBrokerClient(
            plan.broker_router, cfg.broker.request_timeout_s, identity=f"rollout{worker_rank}"
        )
        self.router = LeastLoadedRouter(
            [AsyncEngineClient(u, cfg.rollout.request_timeout_s) for u in plan.engine_urls]
        )
        self.params = sampling_params(cfg)
        # group ids unique across workers without coordination
        self.worker_rank = worker_rank
        self.group_ids = itertools.count(first_group_id, num_workers)
        self.stop = asyncio.Event()
        self.failed: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()

    async def rollout_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        n = self.cfg.rollout.n_samples_per_prompt
        params = [{**self.params, "sampling_seed": sample_seed(self.cfg.seed, gid, i, n)}
                  for i in range(n)]
        t_start = time.time()
        async with self.router.pick() as engine:
            results = await engine.generate([prompt.input_ids] * n, params, return_logprob=True)
        t_end = time.time()
        group: Group = []
        for res in results:
            response = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            reward = self.reward_fn(RewardInput(
                prompt=prompt.text, response=response, label=prompt.label,
                metadata=prompt.metadata, finish_reason=res.finish_reason,
            ))
            version = int(res.weight_version) if res.weight_version is not None else 0
            group.append(Sample(
                prompt_id=prompt.prompt_id, group_id=gid,
                prompt_ids=prompt.input_ids, response_ids=res.output_ids,
                loss_mask=[1.0] * len(res.output_ids), rollout_logprobs=res.logprobs,
                reward=float(reward), version=version, version_min=version,
                finish_reason=res.finish_reason,
                metadata={"t_start": t_start, "t_end": t_end, "worker": self.worker_rank,
                          "data_state": data_state},
            ))
        await self.broker.put_group(group)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failed is None:
            self.failed = task.exception()
            self.stop.set()

    async def run(self) -> None:
        limit = self.cfg.rollout.max_inflight_groups
        while not self.stop.is_set():
            room = limit - len(self.tasks)
            if room <= 0:
                await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
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
                task = asyncio.create_task(self.rollout_group(
                    prompt, next(self.group_ids), self.dataset.state_dict()))
                self.tasks.add(task)
                task.add_done_callback(self._done)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.failed is not None:
            raise self.failed


async def _amain(run_dir: Path) -> None:
    cfg = load_config(run_dir / "config.yaml")
    worker = RolloutWorker(cfg, run_dir)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop.set)
    try:
        await worker.run()
    finally:
        worker.broker.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(message)s")
    asyncio.run(_amain(args.run_dir))


if __name__ == "__main__":
    main()
