"""One /generate request for the groups a worker starts together.

Admission hands the worker credits in bursts (a whole step's worth in sync mode), and each
admitted group becomes a task that asks an engine for its `n` responses. Sent one by one, a
burst of 32 groups is 32 HTTP round trips, 32 JSON bodies and, on the hf engine, work split
across several generate calls. `CoalescingEngine` gathers the calls made in the same turn of
the event loop into one batched /generate (SGLang's list form of `input_ids`, one sampling-params
dict per sequence) of at most `max_groups` calls, and hands each caller its slice back.

The price: a batched request returns when its slowest sequence ends, so on a GPU engine with
long, uneven generations a group waits for the others in its request. `rollout.groups_per_request`
sets `max_groups` (1 sends every group on its own, as before).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from relax_slurm.engines.async_client import AsyncEngineClient
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.version_gate import VersionGate


@dataclass
class _Call:
    input_ids: list[list[int]]
    params: list[dict[str, Any]]
    future: asyncio.Future
    media: list[dict[str, list[str]]] | None = None
    routed_start: int = 0


class CoalescingEngine:
    """`generate` like AsyncEngineClient's, batched with the calls of the same loop turn."""

    def __init__(self, engine: AsyncEngineClient, max_groups: int,
                 gate: VersionGate | None = None) -> None:
        """`gate`: told of every answer's versions (an engine behind the broker's floor gets no
        more requests, version_gate.py)."""
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups}: must be >= 1")
        self.gate = gate
        self.engine = engine
        self.max_groups = max_groups
        self._pending: list[_Call] = []
        self._flush_scheduled = False
        self._requests: set[asyncio.Task] = set()  # keeps in-flight requests referenced

    @property
    def url(self) -> str:
        return self.engine.url

    async def generate(self, input_ids: list[list[int]],
                       sampling_params: dict[str, Any] | list[dict[str, Any]],
                       media: list[dict[str, list[str]]] | None = None,
                       routed_start: int = 0) -> list[GenerateResult]:
        """The responses to `input_ids` (with log-probs), from a request shared with others;
        `media`: per input {kind: [items]} (multimodal prompts); `routed_start`: the first
        position whose routed experts are wanted (a shared request asks from its calls' lowest:
        SGLang takes one routed_experts_start_len per request; each result's `routed_start`
        says where its rows begin)."""
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(input_ids))
        if self.max_groups == 1:
            results = await self.engine.generate(input_ids, params, return_logprob=True,
                                                 media=media, routed_start=routed_start)
        else:
            results = await self._shared(input_ids, params, media, routed_start)
        if self.gate is not None:
            self.gate.check(self.url, results)
        return results

    async def _shared(self, input_ids, params, media, routed_start) -> list[GenerateResult]:
        loop = asyncio.get_running_loop()
        call = _Call(list(input_ids), list(params), loop.create_future(), media, routed_start)
        self._pending.append(call)
        if len(self._pending) >= self.max_groups:
            self._flush()
        elif not self._flush_scheduled:
            # the other tasks of this burst run in this same turn; the flush runs after them
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await call.future

    def _flush(self) -> None:
        self._flush_scheduled = False
        calls, self._pending = self._pending, []
        if calls:
            task = asyncio.ensure_future(self._send(calls))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _send(self, calls: list[_Call]) -> None:
        ids = [seq for c in calls for seq in c.input_ids]
        params = [p for c in calls for p in c.params]
        media = None
        if any(c.media for c in calls):
            media = [m for c in calls for m in (c.media or [{}] * len(c.input_ids))]
        try:
            results = await self.engine.generate(ids, params, return_logprob=True, media=media,
                                                 routed_start=min(c.routed_start for c in calls))
        except asyncio.CancelledError:
            for c in calls:
                c.future.cancel()
            raise
        except Exception as e:  # every caller of the shared request sees its failure
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
            return
        start = 0
        for c in calls:
            end = start + len(c.input_ids)
            if not c.future.done():  # a cancelled caller (shutdown) no longer wants it
                c.future.set_result(results[start:end])
            start = end

    async def aclose(self) -> None:
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
        await self.engine.aclose()
