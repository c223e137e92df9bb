"""Single-turn rollout (no env.name): one prompt -> n responses from one engine -> rewards
(+ the teacher's log-probs) -> one group on the broker.

The n responses go as one batched `/generate` (groups started together share one request,
rollout/coalesce.py); a sequence a weight sync aborts (weight_sync.pause_mode=abort) is continued
from its prefix on the new weights (rollout/partial.py, rollout.partial_rollout). Multimodal
prompts are processed by the model's processors in `data.media_num_workers` threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from relax_slurm.broker.wire import Packed, pack_group
from relax_slurm.data import Prompt
from relax_slurm.data.processor import MediaLimits, MediaProcessor, Processed
from relax_slurm.rewards import RewardInput
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.partial import generate_resuming, version_record
from relax_slurm.rollout.sampling import (check_media_tokens, cut_at_media_pads,
                                          shaped_rewards)
from relax_slurm.rollout.services import RolloutServices
from relax_slurm.sample_meta import SampleMeta


class SingleTurn:
    """The single-turn mode of the rollout worker: `rollout_group` per admitted prompt."""

    def __init__(self, svc: RolloutServices) -> None:
        self.svc = svc
        self.media: MediaProcessor | None = None
        self.media_pool: concurrent.futures.Executor | None = None
        d = svc.cfg.data
        if d.multimodal_keys:  # the model's processors and the threads that run them
            self.media = MediaProcessor(svc.cfg.model.path, svc.tokenizer.get_vocab(),
                                        MediaLimits.of(d))
            self.media_pool = concurrent.futures.ThreadPoolExecutor(
                d.media_num_workers, thread_name_prefix="media")

    async def processed(self, prompt: Prompt) -> Processed:
        """The prompt's ids with media pads expanded and its media tensors (text: as is)."""
        if self.media is None or not any(prompt.media.values()):
            return Processed(input_ids=list(prompt.input_ids))
        with self.svc.phases("media"):
            return await asyncio.get_running_loop().run_in_executor(
                self.media_pool, self.media.process, prompt.input_ids, prompt.media,
                f"prompt {prompt.prompt_id}")

    async def score(self, prompt: Prompt, results: list[GenerateResult]
                    ) -> tuple[list[float], int]:
        """Every response's reward from the pool; (rewards, number of errors)."""
        inputs = [RewardInput(prompt=prompt.text, label=prompt.label, metadata=prompt.metadata,
                              response=self.svc.decode(r.output_ids),
                              finish_reason=r.finish_reason) for r in results]
        scored = await self.svc.score_many(inputs)  # one message per group
        return [value for value, _ in scored], sum(error for _, error in scored)

    async def generate(self, prompt: Prompt, processed: Processed, media: list[dict] | None,
                       gid: int) -> list[GenerateResult]:
        """The group's n responses from one engine. With media the engine gets the prompt's
        own ids, one pad per item, and expands them itself: SGLang's Qwen-VL processors count
        the pads against the items and fail on ids expanded here (a request that never came
        back, on the real server); the hf engine expands the same way."""
        n = self.svc.cfg.rollout.n_samples_per_prompt
        ids = list(prompt.input_ids) if media else processed.input_ids
        params = self.svc.group_params(gid)  # with SGLang's media pad ban (services.py)
        with self.svc.phases("generating"):
            async with self.svc.router.pick() as engine:
                # a sequence a weight sync aborts continues from its prefix
                # (rollout.partial_rollout)
                results = await generate_resuming(engine.generate, [ids] * n, params, media,
                                                  url=engine.url,
                                                  resume=self.svc.cfg.rollout.partial_rollout)
        if processed.tensors:
            check_media_tokens(results, len(processed.input_ids), f"prompt {prompt.prompt_id}")
            results = [cut_at_media_pads(r, self.media.pad_ids.values()) for r in results]
        return results

    async def rollout_group(self, prompt: Prompt, gid: int, data_state: dict) -> None:
        svc, n = self.svc, self.svc.cfg.rollout.n_samples_per_prompt
        t_start = time.time()
        processed = await self.processed(prompt)
        media = ([{k: [r.to_engine() for r in refs] for k, refs in prompt.media.items()}] * n
                 if processed.tensors else None)
        results = await self.generate(prompt, processed, media, gid)
        t_end = time.time()
        (rewards, errors), teacher = await asyncio.gather(
            self.score(prompt, results),
            svc.teacher_logprobs([processed.input_ids] * n, [r.output_ids for r in results],
                                 media=media,
                                 sent_prompts=[list(prompt.input_ids)] * n if media else None))
        t_scored = time.time()
        rewards = shaped_rewards(svc.cfg, rewards, [len(r.output_ids) for r in results])
        counts = await svc.counts_or_filter(rewards, errors)
        if counts is None:
            return
        meta = SampleMeta(t_start=t_start, t_end=t_end, t_scored=t_scored,
                          worker=svc.worker_rank,
                          data_state=data_state, **counts,
                          resumed=sum(bool(r.meta_info.get("num_resumes")) for r in results)
                          or None)
        stamp = meta.to_dict()  # one map for the group's samples (never changed after)
        group = self.group(prompt, gid, processed, results, rewards, teacher, stamp)
        with svc.phases("sending"):
            await svc.broker.put_group(group)

    def group(self, prompt: Prompt, gid: int, processed: Processed,
              results: list[GenerateResult], rewards: list[float], teacher: list,
              stamp: dict) -> Packed:
        """The group as the columns the broker's wire carries, no `Sample` made (broker/wire.py
        `pack_group`, the same checks as `Sample`'s constructor)."""
        n = len(results)
        # tokens from several versions when a sync paused the engine mid-way (retract, or
        # abort and resumed): the staleness rule judges the oldest
        spans = [version_record(res) for res in results]
        versions = [[v for v, _, _ in s] or res.versions() or [0]
                    for s, res in zip(spans, results)]
        outputs = [res.output_ids for res in results]
        return pack_group(
            {"prompt_id": [prompt.prompt_id] * n, "group_id": [gid] * n, "reward": rewards,
             "version": list(map(max, versions)), "version_min": list(map(min, versions)),
             "version_spans": spans, "finish_reason": [res.finish_reason for res in results],
             "multimodal": [{}] * n, "metadata": [stamp] * n},
            {"prompt_ids": [processed.input_ids] * n, "response_ids": outputs,
             "loss_mask": [[1.0] * len(ids) for ids in outputs],
             "rollout_logprobs": [res.logprobs for res in results],
             "teacher_logprobs": teacher,
             "routed_experts": [self.svc.routed_experts(processed.input_ids, res)
                                for res in results]},
            mm_inputs=processed.tensors)  # one dict: the group's samples share its arrays

    def close(self) -> None:
        if self.media_pool is not None:
            self.media_pool.shutdown(wait=False, cancel_futures=True)
