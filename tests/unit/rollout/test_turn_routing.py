"""A multi-turn sample's routed experts from its turns' reports (relax_slurm.routing.segments),
against hand-computed rows, and what the trainer makes of positions no report covers.

Reports are built so that each row says where it came from: position p of turn t's report holds
experts (t, p % 8) in its two layers (top-1), so an assembled array reads as "which turn's
forward routed this position"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.multiturn import Episode
from relax_slurm.routing.segments import NOT_ROUTED, TurnRouting, covered_positions, sample_rows
from relax_slurm.routing.shape import RoutingShape, encode_routed_experts
from relax_slurm.samples import Sample
from relax_slurm.trainer.batch import collate, prepare_items

SHAPE = RoutingShape(layers=2, topk=1, experts=8, moe_layers=(0, 1))
X = NOT_ROUTED


def report(turn: int, start: int, end: int) -> str:
    """Turn `turn`'s engine report of positions start .. end - 1."""
    return encode_routed_experts(np.array([[[turn], [p % 8]] for p in range(start, end)],
                                          dtype=np.int32).reshape(-1, 2, 1))


def turn(tr: TurnRouting, input_ids: list[int], output_ids: list[int], tag: int,
         start: int | None = None, generated: int | None = None) -> int:
    """One turn as an engine answers it: a report from `start` (default: what the tracker asks
    for) to input + generated - 1. Returns the start the tracker asked for."""
    asked = tr.start_for(input_ids)
    start = asked if start is None else start
    generated = len(output_ids) if generated is None else generated
    tr.add(input_ids, output_ids, generated, start,
           report(tag, start, len(input_ids) + generated - 1))
    return asked


def rows(tr: TurnRouting, tokens: list[int]) -> list[list[int]]:
    return sample_rows(tr, tokens, SHAPE).reshape(-1, 2).tolist()


def test_turns_cover_every_position_from_the_forward_that_processed_it():
    tr = TurnRouting()
    prompt, out1, obs, out2 = [1, 2, 3], [4, 5], [6, 7], [8, 9]
    assert turn(tr, prompt, out1, tag=1) == 0
    # turn 2's prefill is the first forward of position 4 (turn 1's last token) and the
    # observation: it reports from there on
    assert turn(tr, prompt + out1 + obs, out2, tag=2) == 4
    tokens = prompt + out1 + obs + out2  # 9 tokens, positions 0..7 routed
    assert rows(tr, tokens) == [[1, 0], [1, 1], [1, 2], [1, 3],
                                [2, 4], [2, 5], [2, 6], [2, 7]]
    assert (tr.covered, tr.turns, tr.missing) == (8, 2, 0)


def test_a_batched_request_from_a_lower_start_keeps_the_earlier_turns_rows():
    """The coalescer sends a shared request's lowest start: rows an earlier turn holds stay."""
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    assert turn(tr, [1, 2, 3, 4, 5, 6], [7], tag=2, start=1) == 4
    assert rows(tr, [1, 2, 3, 4, 5, 6, 7]) == [[1, 0], [1, 1], [1, 2], [1, 3], [2, 4], [2, 5]]


def test_a_trailing_observation_is_not_routed():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    # the environment appended [6, 7] after the final turn: no forward processed 5 and 6
    assert rows(tr, [1, 2, 3, 4, 5, 6, 7]) == [[1, 0], [1, 1], [1, 2], [1, 3], [X, X], [X, X]]
    routed = sample_rows(tr, [1, 2, 3, 4, 5, 6, 7], SHAPE)
    assert covered_positions(routed, 6) == 4


def test_a_retokenised_history_keeps_its_common_prefix_and_asks_for_the_rest():
    """Position p's routing depends on tokens 0..p: the rows of the prefix the new input
    repeats stay; the turn's report covers the rest."""
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    assert turn(tr, [1, 2, 9, 9, 6], [7], tag=2) == 2  # re-tokenised after two tokens
    assert rows(tr, [1, 2, 9, 9, 6, 7]) == [[1, 0], [1, 1], [2, 2], [2, 3], [2, 4]]


def test_no_common_prefix_falls_back_to_the_final_turns_full_report():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    assert turn(tr, [7, 2, 3, 4, 5, 6], [8], tag=2) == 0
    assert rows(tr, [7, 2, 3, 4, 5, 6, 8]) == [[2, p] for p in range(6)]


def test_final_tokens_that_leave_the_history_keep_only_the_shared_prefix():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    assert rows(tr, [1, 2, 9, 4, 5]) == [[1, 0], [1, 1], [X, X], [X, X]]


def test_a_turn_without_a_report_is_covered_by_the_next_turns():
    tr = TurnRouting()
    tr.add([1, 2, 3], [4, 5], 2, 0, None)  # this engine sent no routing
    assert tr.missing == 1 and tr.start_for([1, 2, 3, 4, 5, 6]) == 0
    turn(tr, [1, 2, 3, 4, 5, 6], [7], tag=2)
    assert rows(tr, [1, 2, 3, 4, 5, 6, 7]) == [[2, p] for p in range(6)]
    # the final turn without one: its positions stay unrouted
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    tr.add([1, 2, 3, 4, 5, 6], [7], 1, 4, None)
    assert rows(tr, [1, 2, 3, 4, 5, 6, 7]) == [[1, 0], [1, 1], [1, 2], [1, 3], [X, X], [X, X]]
    # none at all: no routing (a dense model's or an engine without the flag)
    tr = TurnRouting()
    tr.add([1, 2, 3], [4, 5], 2, 0, None)
    assert sample_rows(tr, [1, 2, 3, 4, 5], SHAPE) is None


def test_a_response_cut_short_drops_the_rows_of_the_tokens_it_lost():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4], tag=1, generated=3)  # the engine generated 3, one kept
    assert tr.covered == 3
    assert turn(tr, [1, 2, 3, 4, 6], [7], tag=2) == 3
    assert rows(tr, [1, 2, 3, 4, 6, 7]) == [[1, 0], [1, 1], [1, 2], [2, 3], [2, 4]]


def test_a_report_that_skips_positions_is_refused():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    with pytest.raises(ValueError, match="routed_experts_start_len=4"):
        tr.add([1, 2, 3, 4, 5, 6], [7], 1, 5, report(2, 5, 6))
    with pytest.raises(ValueError, match="covers 3 tokens, expected 2"):  # engine's count off
        tr.add([1, 2, 3, 4, 5, 6], [7], 1, 4, report(2, 4, 7))
        sample_rows(tr, [1, 2, 3, 4, 5, 6, 7], SHAPE)


def test_an_episode_records_its_turns_routing():
    """Episode.add_turn feeds the tracker from the engine's results (routed_start included)."""
    ep = Episode(prompt_ids=[1, 2, 3])
    ep.add_turn(GenerateResult([4, 5], [-1.0, -1.0], "stop", "0",
                               routed_experts=report(1, 0, 4)))
    ep.add([6], model=False)
    ids = ep.prompt_ids + ep.response_ids
    assert ep.routing.start_for(ids) == 4
    ep.add_turn(GenerateResult([7], [-1.0], "stop", "0", routed_experts=report(2, 2, 6),
                               routed_start=2), ids)
    assert rows(ep.routing, ep.prompt_ids + ep.response_ids) == [
        [1, 0], [1, 1], [1, 2], [1, 3], [2, 4], [2, 5]]


def test_the_trainer_neither_compares_nor_replays_unrouted_positions():
    tr = TurnRouting()
    turn(tr, [1, 2, 3], [4, 5], tag=1)
    tokens = [1, 2, 3, 4, 5, 6, 7]  # a trailing observation
    sample = Sample(prompt_id="p", group_id=0, prompt_ids=tokens[:3], response_ids=tokens[3:],
                    loss_mask=[1, 1, 0, 0], rollout_logprobs=[-1.0] * 4, reward=1.0,
                    routed_experts=sample_rows(tr, tokens, SHAPE))
    full = Sample(prompt_id="p", group_id=0, prompt_ids=[1, 2], response_ids=[3],
                  loss_mask=[1], rollout_logprobs=[-1.0], reward=0.0,
                  routed_experts=np.zeros(2 * 2, dtype=np.int16))
    mb = collate(prepare_items([[sample, full]], AlgoConfig()), pad_id=0,
                 device=torch.device("cpu"))
    assert mb.routed_valid().tolist() == [[True, True, True, True, False, False, False],
                                          [True, True, False, False, False, False, False]]


def test_the_hf_engine_takes_a_start_up_to_each_inputs_length_as_sglang():
    """SGLang's scheduler aborts a request whose routed_experts_start_len is below 0 or above an
    input's length (a 400); up to the length it returns rows from there (none at the length
    when one token was generated: seqlen - 1 - start)."""
    from relax_slurm.engines.hf.parsing import BadRequest, parse_routing_request

    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    assert parse_routing_request({"return_routed_experts": True}, prompts) == 0
    assert parse_routing_request({"return_routed_experts": True,
                                  "routed_experts_start_len": 3}, prompts) == 3
    assert parse_routing_request({"routed_experts_start_len": 3}, prompts) is None  # not asked
    for bad in (4, -1, True, "2"):
        with pytest.raises(BadRequest, match="routed_experts_start_len"):
            parse_routing_request({"return_routed_experts": True,
                                   "routed_experts_start_len": bad}, prompts)


def test_a_shared_request_asks_from_its_calls_lowest_start():
    """SGLang takes one routed_experts_start_len per request: the coalescer sends the lowest of
    its calls', and each result says where its rows begin (TurnRouting keeps its own)."""
    import asyncio

    from relax_slurm.rollout.coalesce import CoalescingEngine

    class Engine:
        url = "http://fake"
        sent: list = []

        async def generate(self, input_ids, params, return_logprob=True, media=None,
                           routed_start=0):
            self.sent.append((len(input_ids), routed_start))
            return [GenerateResult([1], [-1.0], "stop", "0", routed_start=routed_start)
                    for _ in input_ids]

    async def main():
        engine = CoalescingEngine(Engine(), max_groups=4)
        return await asyncio.gather(engine.generate([[1, 2, 3, 4, 5]], [{}], routed_start=5),
                                    engine.generate([[1, 2, 3]], [{}], routed_start=3))

    results = asyncio.run(main())
    assert Engine.sent == [(2, 3)]
    assert [r.routed_start for [r] in results] == [3, 3]
