"""What a rollout sample is made of, as pure functions: seeds and sampling parameters, shaped
rewards, a response cut at media pads, the teacher's response log-probs, routed experts.

Shared by the rollout modes (rollout/single_turn.py, rollout/episodes.py, the agent proxy);
no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from relax_slurm.config import TrainConfig
from relax_slurm.errors import ConfigError
from relax_slurm.rewards.shaping import overlong_penalty
from relax_slurm.engines import sglang_api
from relax_slurm.engines.client import GenerateResult
from relax_slurm.routing.shape import RoutingShape, decode_routed_experts


def sample_seed(run_seed: int, group_id: int, index: int, n: int) -> int:
    """SGLang `sampling_seed` of one sample: a pure function of (run seed, group, index), so a
    resumed run draws exactly the tokens the uninterrupted run would have drawn."""
    return (run_seed << 40) + group_id * n + index


def sampling_params(cfg: TrainConfig) -> dict:
    r = cfg.rollout
    return {
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
    }


MEDIA_PAD_BIAS = -1e30
"""Added to a media pad's logit: its probability is 0 in float32, as the trainer's lowest logit
makes it (a finite number: JSON has no -inf)."""


def media_pad_ban(pad_ids: Iterable[int]) -> dict:
    """Sampling parameters that keep an SGLang engine from sampling media pad tokens, as the hf
    engine never does and as the trainer's softmax excludes them (trainer/step.py). SGLang adds
    `logit_bias` before its softmax, so its log-probs are then normalised over the same tokens
    as the trainer's: without it they were lower by the pads' share of the probability (0.1 for
    the tiny VL model's 2 pads of 22 tokens at step 0, issue #33), and a pad sampled by a
    barely trained model cut the response.

    >>> media_pad_ban([21, 20])
    {'logit_bias': {'20': -1e+30, '21': -1e+30}}
    """
    return {"logit_bias": {str(t): MEDIA_PAD_BIAS for t in sorted(set(pad_ids))}}


def check_media_tokens(results: list[GenerateResult], expanded_len: int, where: str) -> None:
    """ConfigError unless the engine expanded the prompt's media to as many tokens as the worker
    did (`meta_info.prompt_tokens`; results resumed across a sync are skipped: their count is
    the worker's own). The samples carry the worker's ids and tensors: the trainer would score
    other tokens than the engine sampled from. SGLang runs its own image processor, configured
    by the model directory and --mm-process-config (the launcher passes data.image_*_pixels
    there: sglang_api.mm_process_args); its video frames it samples itself.

    >>> r = GenerateResult([5], [-1.0], "stop", "0", meta_info={"prompt_tokens": 9})
    >>> check_media_tokens([r], 7, "prompt 3")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    relax_slurm.errors.ConfigError: prompt 3: the engine expanded the prompt's media to 9 tokens, the rollout worker to 7 ...
    """
    for r in results:
        got = r.meta_info.get("prompt_tokens")
        if got is None or r.meta_info.get("num_resumes") or got == expanded_len:
            continue
        raise ConfigError(
            f"{where}: the engine expanded the prompt's media to {got} tokens, the rollout "
            f"worker to {expanded_len} (with the same ids and media): their processors resize "
            "images or sample video frames differently, and the trainer would score other "
            "tokens than the engine sampled. Fix: give the engine the worker's limits (SGLang "
            "gets data.image_*_pixels as --mm-process-config unless rollout.engine_extra_args "
            "has its own; it samples video frames itself: see docs/engines.md, vision-language "
            "on SGLang), or set data.image_*_pixels / data.video_* to the engine's")


def seeded_params(params: dict, run_seed: int, group_id: int, n: int) -> list[dict]:
    """The group's n per-sample parameters: `params` with each sample's own seed."""
    return [{**params, "sampling_seed": sample_seed(run_seed, group_id, i, n)} for i in range(n)]


def shaped_rewards(cfg: TrainConfig, rewards: list[float], lengths: list[int]) -> list[float]:
    """Rewards with the soft overlong penalty added (algo.overlong_buffer_tokens, 0 = off)."""
    a = cfg.algo
    return [r + overlong_penalty(n, cfg.rollout.max_new_tokens, a.overlong_buffer_tokens,
                                 a.overlong_penalty_factor)
            for r, n in zip(rewards, lengths)]


def cut_at_media_pads(res: GenerateResult, pad_ids: Iterable[int]) -> GenerateResult:
    """A response cut before its first media pad token, finish reason "length" (the trainer's
    forward would read a pad as a media slot). No engine samples them (the hf engine bans them,
    SGLang gets `media_pad_ban`); kept for an engine that ignores its logit_bias.

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


def no_routing_error() -> ConfigError:
    """What replay (algo.routing_replay) says of an engine that reports no routing."""
    return ConfigError(
        "algo.routing_replay=true but the engine returned no meta_info.routed_experts: "
        f"start SGLang with {sglang_api.ROUTED_EXPERTS_FLAG} (relax-train adds it to the "
        "engines it starts for an MoE model.path; check externally started engines)")


def sample_routing(res: GenerateResult, prompt_len: int, shape: RoutingShape, *,
                   required: bool) -> np.ndarray | None:
    """A response's routed experts as a sample carries them (flat int16, one row per prompt +
    response token but the last), or None when the engine sent none; `required`
    (algo.routing_replay) makes that a ConfigError naming the engine flag."""
    if res.routed_experts is None:
        if required:
            raise no_routing_error()
        return None
    # decoded for every token generated; a response cut short here (at a media pad) drops the
    # rows of the tokens it lost
    generated = int(res.meta_info.get("completion_tokens", len(res.output_ids)))
    ids = decode_routed_experts(res.routed_experts, shape, prompt_len + generated - 1)
    return ids[:(prompt_len + len(res.output_ids) - 1) * shape.layers * shape.topk]
