"""Partial rollouts: a sequence a weight sync aborted (weight_sync.pause_mode=abort) continues
from its prefix instead of being generated again from scratch.

An aborted sequence comes back with finish_reason abort and the tokens it had. The worker sends
prompt + those tokens again, with the rest of the token budget and a seed derived from the
sequence's own; the engine holds the request while it is paused (SGLang's tokenizer manager and
the hf engine alike) and runs it on the weights served after the sync. The pieces are joined in
token order (`merge`):

- tokens and their log-probs: each log-prob stays the one of the weights that sampled its
  token (the engine returns log-probs of the new tokens only);
- version spans (`meta_info.weight_versions`): the second piece's shifted by the first's length,
  so the sample records which version sampled which tokens;
- routed experts (MoE): every position keeps the routing of the forward that sampled the token
  after it, i.e. the first piece's rows for the prefix and the second's from there on (the
  second request's prefill routes the prefix again, on the new weights; those rows are dropped).

Only the sampling params the worker sends are supported: a stop string that straddles the cut
would be missed by the engine, so sequences with `stop` strings are not resumed (multi-turn
episodes, which use them, regenerate their group as before).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from relax_slurm.errors import EngineError
from relax_slurm.engines.client import GenerateResult, raise_if_aborted
from relax_slurm.engines.seeds import mix64

MAX_RESUMES = 16
"""Resumes of one request's sequences before they count as aborted for good (each resume needs
another pause to land mid-way; a flood of them means something else aborts requests)."""
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128

Generate = Callable[..., Awaitable[list[GenerateResult]]]


def derive_seed(seed: Optional[int], done: int) -> Optional[int]:
    """The `sampling_seed` of a sequence resumed after `done` tokens: a pure function of its
    own seed and the prefix length (splitmix64, kept within int64 as SGLang checks it), so a
    resumed piece does not replay the uniforms its prefix already drew (the hf engine seeds a
    generator per request; SGLang hashes the seed with the position and would not need it).

    >>> derive_seed(7, 0), derive_seed(None, 5)
    (7, None)
    >>> derive_seed(7, 5) == derive_seed(7, 5) != derive_seed(7, 6)
    True
    """
    if seed is None or done == 0:
        return seed
    return mix64(seed * 0x9E3779B97F4A7C15 + done) >> 1  # 63 bits: a non-negative int64


def resume_params(params: dict[str, Any], done: int) -> dict[str, Any]:
    """A sequence's sampling params for its continuation after `done` tokens."""
    budget = int(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS))
    out = {**params, "max_new_tokens": budget - done}
    if params.get("sampling_seed") is not None:
        out["sampling_seed"] = derive_seed(int(params["sampling_seed"]), done)
    return out


def output_spans(res: GenerateResult) -> list[tuple[str, int, int]]:
    """(version, start, end) runs of `res.output_ids`, empty ones dropped; one run of
    `weight_version` when the engine reported no spans."""
    spans = res.weight_versions or ([(res.weight_version, 0, len(res.output_ids))]
                                    if res.weight_version is not None else [])
    return [(str(v), a, b) for v, a, b in spans if b > a]


def version_record(res: GenerateResult, offset: int = 0) -> list[list[int]]:
    """A sample's `version_spans` for `res`'s tokens placed at `offset` in its response: int
    versions, runs clipped to the tokens kept (a response cut short keeps fewer).

    >>> version_record(GenerateResult([5, 6, 7], [], "stop", "4", weight_versions=[
    ...     ("3", 0, 1), ("4", 1, 3)]), offset=10)
    [[3, 10, 11], [4, 11, 13]]
    """
    n = len(res.output_ids)
    return [[int(v), a + offset, min(b, n) + offset] for v, a, b in output_spans(res)
            if a < min(b, n)]


def join_spans(first: list[tuple[str, int, int]], then: list[tuple[str, int, int]],
               offset: int) -> list[tuple[str, int, int]]:
    """`first`, then `then` shifted by `offset`; adjacent runs of one version become one.

    >>> join_spans([("3", 0, 4)], [("3", 0, 2), ("4", 2, 5)], 4)
    [('3', 0, 6), ('4', 6, 9)]
    """
    out = list(first)
    for v, a, b in then:
        if out and out[-1][0] == v and out[-1][2] == a + offset:
            out[-1] = (v, out[-1][1], b + offset)
        else:
            out.append((v, a + offset, b + offset))
    return out


def join_routing(first: Optional[str], then: Optional[str], kept_rows: int
                 ) -> Optional[str]:
    """Routed experts (base64 int32, one row per position) of a resumed sequence: `first`'s
    `kept_rows` rows (prompt + prefix - 1: the forwards that sampled the prefix), then `then`'s
    rows from there on. An aborted piece without them leaves `then`'s whole (its prefill
    routed the prefix again on the new weights: what a retract reports too)."""
    if then is None or first is None or kept_rows <= 0:
        return then
    a, b = base64.b64decode(first), base64.b64decode(then)
    row = len(a) // kept_rows if kept_rows else 0
    if row == 0 or len(a) != kept_rows * row or len(b) < len(a) or len(b) % row:
        raise EngineError(f"routed experts of a resumed sequence do not line up: {len(a)} bytes "
                          f"for {kept_rows} positions, then {len(b)} bytes")
    return base64.b64encode(a + b[len(a):]).decode("ascii")


def merge(first: GenerateResult, then: GenerateResult, prompt_len: int) -> GenerateResult:
    """`first` (aborted after its tokens) continued by `then`, generated from prompt + `first`'s
    tokens: one result as if the engine had generated it in one go across the sync."""
    k = len(first.output_ids)
    output_ids = [*first.output_ids, *then.output_ids]
    spans = join_spans(output_spans(first), output_spans(then), k)
    meta = {**then.meta_info, "prompt_tokens": prompt_len, "completion_tokens": len(output_ids),
            "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in spans],
            "num_resumes": int(first.meta_info.get("num_resumes", 0)) + 1}
    return GenerateResult(
        output_ids=output_ids, logprobs=[*first.logprobs, *then.logprobs],
        finish_reason=then.finish_reason, weight_version=then.weight_version,
        text=first.text + then.text, meta_info=meta, input_logprobs=first.input_logprobs,
        weight_versions=spans,
        routed_experts=join_routing(first.routed_experts, then.routed_experts,
                                    prompt_len + k - 1))


def resumable(params: dict[str, Any]) -> bool:
    """Whether a sequence with these sampling params can be continued from its prefix (see the
    module docstring: no stop strings)."""
    return not params.get("stop")


async def generate_resuming(generate: Generate, input_ids: list[list[int]],
                            params: list[dict[str, Any]], media: Optional[list] = None, *,
                            url: str = "", resume: bool = True) -> list[GenerateResult]:
    """`generate(input_ids, params, media=...)`, with every aborted sequence continued from
    its prefix until it ends (at most MAX_RESUMES rounds); EngineAborted (raise_if_aborted) if
    one still ends aborted, or at once when `resume` is false or a sequence is not
    `resumable`."""
    results = await generate(input_ids, params, media=media)
    for _ in range(MAX_RESUMES):
        todo = [i for i, r in enumerate(results) if r.finish_reason == "abort"]
        if not resume or not todo or not all(resumable(params[i]) for i in todo):
            break
        sent = []
        for i in todo:
            done = len(results[i].output_ids)
            p = resume_params(params[i], done)
            if p["max_new_tokens"] <= 0:  # the budget was used up just as the abort came
                results[i] = dataclasses.replace(results[i], finish_reason="length")
            else:
                sent.append((i, p))
        if not sent:
            continue
        again = await generate([[*input_ids[i], *results[i].output_ids] for i, _ in sent],
                               [p for _, p in sent],
                               media=[media[i] for i, _ in sent] if media else None)
        for (i, _), res in zip(sent, again):  # a further abort resumes from the whole prefix
            results[i] = merge(results[i], res, len(input_ids[i]))
    return raise_if_aborted(results, url)
