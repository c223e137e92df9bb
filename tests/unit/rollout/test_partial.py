"""Partial rollouts' bookkeeping (rollout/partial.py): seeds, params, the joined tokens,
log-probs, version spans and routed experts of a sequence aborted by a sync and resumed.
The resume against a real engine across a real sync: tests/integration/test_partial_rollout.py."""

from __future__ import annotations

import asyncio
import base64
import doctest

import numpy as np
import pytest

from relax_slurm.errors import EngineAborted, EngineError
from relax_slurm.rollout import partial
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.partial import (
    MAX_RESUMES, derive_seed, generate_resuming, join_routing, merge, resume_params,
    version_record,
)
from relax_slurm import samples
from relax_slurm.samples import Sample

LAYERS, TOPK = 2, 3  # routed experts: one [LAYERS x TOPK] int32 row per position


def routing(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode("ascii")


def result(ids, lps, finish, spans, routed=None) -> GenerateResult:
    return GenerateResult(output_ids=list(ids), logprobs=list(lps), finish_reason=finish,
                          weight_version=spans[-1][0] if spans else None,
                          weight_versions=spans, routed_experts=routed,
                          meta_info={"completion_tokens": len(ids)})


def test_doctests():
    assert doctest.testmod(partial).failed == 0 and doctest.testmod(samples).failed == 0


def test_derived_seeds_are_int64_distinct_and_the_seed_itself_without_a_prefix():
    seeds = [derive_seed(s, k) for s in (0, 1, (1 << 40) + 17) for k in range(1, 200)]
    assert all(0 <= x < 1 << 63 for x in seeds) and len(set(seeds)) == len(seeds)
    assert derive_seed(12, 0) == 12 and derive_seed(None, 3) is None
    p = resume_params({"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 5}, 4)
    assert p == {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": derive_seed(5, 4)}


def test_merge_concatenates_tokens_logprobs_spans_and_routing():
    prompt_len, rng = 3, np.random.default_rng(0)
    old_rows = rng.integers(0, 8, (prompt_len + 4 - 1, LAYERS, TOPK))  # prefix of 4 tokens
    new_rows = rng.integers(0, 8, (prompt_len + 4 + 3 - 1, LAYERS, TOPK))  # its continuation
    first = result([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0], "abort", [("3", 0, 4)],
                   routing(old_rows))
    then = result([9, 10, 1], [-5.0, -6.0, -7.0], "stop", [("4", 0, 3)], routing(new_rows))
    got = merge(first, then, prompt_len)
    assert got.output_ids == [5, 6, 7, 8, 9, 10, 1]
    assert got.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]  # each its own weights'
    assert got.finish_reason == "stop" and got.weight_version == "4"
    assert got.weight_versions == [("3", 0, 4), ("4", 4, 7)] and got.versions() == [3, 4]
    assert got.meta_info["completion_tokens"] == 7 and got.meta_info["num_resumes"] == 1
    assert got.meta_info["weight_versions"][1] == {"version": "4", "start": 4, "end": 7}
    # positions 0..5 sampled the prefix on the old weights; from 6 on the new forward did
    rows = np.frombuffer(base64.b64decode(got.routed_experts), np.int32).reshape(-1, LAYERS, TOPK)
    np.testing.assert_array_equal(rows, np.concatenate([old_rows, new_rows[6:]]))
    # the sample it becomes records the two runs, and judges the oldest version
    spans = version_record(got)
    sample = Sample(prompt_id="p", group_id=0, prompt_ids=[1, 2, 3], response_ids=got.output_ids,
                    loss_mask=[1.0] * 7, rollout_logprobs=got.logprobs, version=4,
                    version_min=3, version_spans=spans)
    assert sample.version_spans == [[3, 0, 4], [4, 4, 7]] and sample.multi_version


def test_spans_of_one_version_join_and_a_cut_response_keeps_its_runs():
    first = result([5, 6], [-1.0, -1.0], "abort", [("3", 0, 2)])
    then = result([7], [-1.0], "length", [("3", 0, 1)])  # no sync came: still version 3
    assert merge(first, then, 2).weight_versions == [("3", 0, 3)]
    cut = result([5], [-1.0], "length", [("3", 0, 1), ("4", 1, 3)])  # cut at a media pad
    assert version_record(cut) == [[3, 0, 1]]
    assert version_record(result([5, 6], [-1.0, -1.0], "stop", [])) == []


def test_routing_that_does_not_line_up_is_an_error_and_a_missing_prefix_takes_the_rerouting():
    rows = routing(np.zeros((4, LAYERS, TOPK)))
    with pytest.raises(EngineError, match="do not line up"):
        join_routing(rows, routing(np.zeros((3, LAYERS, TOPK))), kept_rows=4)
    # an aborted piece that reported none: the second piece's prefill routed the prefix again
    assert join_routing(None, rows, kept_rows=2) == rows
    assert join_routing(None, rows, kept_rows=0) == rows  # nothing generated before the abort
    assert join_routing(rows, None, kept_rows=2) is None


class Script:
    """A generate callable answering from a list of canned rounds, recording what it was sent."""

    def __init__(self, *rounds) -> None:
        self.rounds, self.sent = list(rounds), []

    async def __call__(self, input_ids, params, media=None):
        self.sent.append((input_ids, params, media))
        return self.rounds.pop(0)


def run(coro):
    return asyncio.run(coro)


def test_aborted_sequences_continue_from_their_prefix_with_the_rest_of_the_budget():
    prompt = [4, 5]
    params = [{"max_new_tokens": 6, "sampling_seed": 100 + i} for i in range(3)]
    gen = Script(
        [result([7, 7], [-1.0, -1.0], "abort", [("0", 0, 2)]),  # aborted mid-way
         result([8] * 6, [-0.5] * 6, "length", [("0", 0, 6)]),  # done before the pause
         result([], [], "abort", [("0", 0, 0)])],  # aborted in the waiting queue
        [result([9] * 4, [-2.0] * 4, "length", [("1", 0, 4)]),
         result([3, 1], [-3.0, -3.0], "stop", [("1", 0, 2)])])
    out = run(generate_resuming(gen, [prompt] * 3, params, media=[{"image": ["a"]}] * 3))
    ids, sent_params, media = gen.sent[1]
    assert ids == [[4, 5, 7, 7], [4, 5]]  # prompt + the tokens so far
    assert [p["max_new_tokens"] for p in sent_params] == [4, 6]
    # a derived seed after a prefix; nothing drawn yet: the sequence's own
    assert [p["sampling_seed"] for p in sent_params] == [derive_seed(100, 2), 102]
    assert media == [{"image": ["a"]}] * 2
    assert out[0].output_ids == [7, 7, 9, 9, 9, 9] and out[0].logprobs == [-1.0] * 2 + [-2.0] * 4
    assert version_record(out[0]) == [[0, 0, 2], [1, 2, 6]]
    assert out[1].output_ids == [8] * 6 and out[1].finish_reason == "length"
    assert version_record(out[2]) == [[1, 0, 2]] and out[2].finish_reason == "stop"


def test_without_resume_with_stop_strings_or_after_max_resumes_the_abort_is_raised():
    aborted = result([7], [-1.0], "abort", [("0", 0, 1)])
    with pytest.raises(EngineAborted):
        run(generate_resuming(Script([aborted]), [[4]], [{"max_new_tokens": 4}], resume=False))
    with pytest.raises(EngineAborted):  # a stop string could straddle the cut
        run(generate_resuming(Script([aborted]), [[4]], [{"max_new_tokens": 4, "stop": ["x"]}]))
    waiting = result([], [], "abort", [("0", 0, 0)])  # aborted again and again, no progress
    gen = Script(*[[waiting]] * (MAX_RESUMES + 1))
    with pytest.raises(EngineAborted):
        run(generate_resuming(gen, [[4]], [{"max_new_tokens": 4}]))
    assert len(gen.sent) == MAX_RESUMES + 1
