"""asyncio HTTP client of an engine, for rollout workers that keep many requests in flight
(the sync client and what both share: engines/client.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import httpx

from relax_slurm.engines import sglang_api
from relax_slurm.engines.client import (ClientBase, GenerateResult, SamplingParams, excluding,
                                        json_body)
from relax_slurm.errors import EngineError
from relax_slurm.engines.served_adapter import ServedAdapter, newest_held

STALE_CONNECTION_RETRIES = 2
"""Retries of a request whose pooled keep-alive connection the server had closed."""


class AsyncEngineClient(ClientBase):
    """asyncio client for rollout workers that keep many requests in flight."""

    def __init__(self, url: str, timeout_s: float = 300.0, max_connections: int = 256,
                 routed_experts: bool = False, lora_path: Optional[str] = None,
                 adapter: Optional[ServedAdapter] = None) -> None:
        super().__init__(url, timeout_s, lora_path, adapter)
        self.routed_experts = routed_experts
        """Ask every /generate for the routed experts (an MoE policy's engines)."""
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, limits=limits,
                                       headers=sglang_api.auth_headers())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncEngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, route: str, body: Any = None) -> httpx.Response:
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            try:
                return await self._http.request(method, route, **json_body(body))
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as e:
                # a pooled keep-alive connection the server closed while idle (uvicorn closes
                # them after 5 s by default, SGLang included): retry on a fresh connection
                if attempt == STALE_CONNECTION_RETRIES:
                    raise self._error(route, e) from e
                await asyncio.sleep(0.05 * (attempt + 1))
            except httpx.HTTPError as e:
                raise self._error(route, e) from e
        raise AssertionError("unreachable")

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True when GET /health answers 200; raises EngineError otherwise."""
        try:
            resp = await self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError as e:
            raise self._error("/health", e) from e
        return self._healthy(resp)

    async def weight_version(self) -> Optional[str]:
        """The version label of the weights served now (GET /model_info, else its older name)."""
        for name in ("/model_info", sglang_api.DEPRECATED_ROUTE["/model_info"]):
            body = self._info(name, await self._call("GET", name))
            if body is not None:
                version = body.get("weight_version")
                return None if version is None else str(version)
        raise EngineError(f"engine {self.url}: no /model_info (HTTP 404): not an SGLang server "
                          f"of {sglang_api.SUPPORTED_SGLANG}?")

    async def generate(self, input_ids: list[list[int]], sampling_params: SamplingParams,
                       return_logprob: bool = True, logprob_start_len: Optional[int] = None,
                       media: Optional[list[dict[str, list[str]]]] = None,
                       routed_start: int = 0, token_ids_logprob: Sequence[int] = ()
                       ) -> list[GenerateResult]:
        """`routed_start`: SGLang's routed_experts_start_len (one for the request; at most each
        input's length), recorded in each result's `routed_start`. `token_ids_logprob`: the
        log-probs of these ids at every position too (meta_info.input_token_ids_logprobs)."""
        if not input_ids:
            return []
        async def send(lora_path: Optional[str]) -> list[GenerateResult]:
            body = self._generate_body(input_ids, sampling_params, return_logprob,
                                       logprob_start_len, media, self.routed_experts,
                                       routed_start, lora_path, token_ids_logprob)
            resp = await self._call("POST", "/generate", body)
            return self._parse_generate(self._json("/generate", resp), len(input_ids))
        results = (await send(self.lora_path) if self.adapter is None
                   else await newest_held(self, send))
        return [dataclasses.replace(r, routed_start=routed_start) if routed_start else r
                for r in results]

    async def prefill_logprobs(self, input_ids: list[list[int]],
                               media: Optional[list[dict[str, list[str]]]] = None,
                               lengths: Optional[list[int]] = None,
                               exclude: Sequence[int] = ()) -> list[list[float]]:
        """Log-probs of tokens 1..L-1 of each sequence given the ones before it, [L-1] each:
        the prefill path of /generate (max_new_tokens=0, logprob_start_len=0), no sampling.
        How a teacher engine scores a student's prompt + response. At temperature 1 on SGLang
        (its prefill reads no sampling params) and on the hf engine alike. `media`: per sequence,
        the images / videos / audio its prompt's pads stand for (as `generate` takes them), one
        pad per item in `input_ids`: the engine expands each to the item's tokens, and
        `lengths` gives each sequence's length so expanded (what the log-probs then cover).
        `exclude`: ids the caller's model never samples (a multimodal model's media pads, which
        the trainer's softmax leaves out); the log-probs are renormalized over the vocabulary
        without them, from their own log-probs at each position (SGLang's token_ids_logprob)."""
        params = {"max_new_tokens": 0}
        results = await self.generate(input_ids, params, return_logprob=True, logprob_start_len=0,
                                      media=media, token_ids_logprob=exclude)
        out = []
        for i, (ids, res) in enumerate(zip(input_ids, results)):
            n = len(ids) if lengths is None else lengths[i]
            lps = res.input_logprobs[1:]  # the first token has no log-prob
            if len(lps) != n - 1 or any(lp is None for lp in lps):
                raise EngineError(f"engine {self.url}/generate: {len(res.input_logprobs)} input "
                                  f"log-probs for {n} input tokens (logprob_start_len=0)")
            if exclude:
                lps = excluding(lps, res.meta_info.get("input_token_ids_logprobs"), self.url)
            out.append([float(lp) for lp in lps])
        return out
