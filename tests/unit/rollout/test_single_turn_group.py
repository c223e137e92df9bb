"""A single-turn group goes from the engine's answers to the broker's wire as columns: no
`Sample` is made on the worker's path, and the trainer decodes the samples the answers make."""

from __future__ import annotations

import types

import numpy as np

from relax_slurm.broker.wire import decode, encode
from relax_slurm.data import Prompt
from relax_slurm.data.processor import Processed
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.single_turn import SingleTurn
from relax_slurm.samples import Sample


def test_a_single_turn_group_is_packed_without_a_sample(monkeypatch) -> None:
    mode = SingleTurn.__new__(SingleTurn)
    mode.svc = types.SimpleNamespace(routed_experts=lambda prompt_ids, res: None)
    results = [
        GenerateResult([11, 12, 13], [-0.5, -1.0, -0.25], "stop", "4"),
        # a sync paused the engine after its first token: two versions, the oldest judged
        GenerateResult([21, 22], [-0.1, -0.2], "length", "5",
                       weight_versions=[("4", 0, 1), ("5", 1, 2)]),
        GenerateResult([], [], "abort", None),
    ]
    prompt = Prompt(prompt_id="p3", input_ids=[1, 2], text="1+1", label="2")
    stamp = {"worker": 1, "data_state": {"epoch": 0, "index": 3}}
    made: list[int] = []
    init = Sample.__post_init__
    monkeypatch.setattr(Sample, "__post_init__", lambda s: (made.append(1), init(s))[1])
    group = mode.group(prompt, 9, Processed(input_ids=[1, 2]), results, [1, 0, 0.5],
                       [None] * 3, stamp)
    frames = [bytes(f) for f in encode("put_group", {}, [group])]
    assert made == []
    monkeypatch.undo()
    [got] = decode(frames)[2]  # type: ignore[misc]
    assert [(s.prompt_id, s.group_id, s.reward, s.finish_reason) for s in got] == [
        ("p3", 9, 1.0, "stop"), ("p3", 9, 0.0, "length"), ("p3", 9, 0.5, "abort")]
    assert [(s.version_min, s.version, s.version_spans) for s in got] == [
        (4, 4, [[4, 0, 3]]), (4, 5, [[4, 0, 1], [5, 1, 2]]), (0, 0, [])]
    for s, res in zip(got, results):
        assert s.prompt_ids.tolist() == [1, 2] and s.response_ids.tolist() == res.output_ids
        np.testing.assert_array_equal(s.rollout_logprobs, np.float32(res.logprobs))
        assert s.loss_mask.tolist() == [1.0] * len(res.output_ids)
        assert s.metadata == stamp and s.teacher_logprobs is None and s.routed_experts is None
