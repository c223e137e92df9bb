"""`pack_group`: a rollout worker's group made from columns, no `Sample` made, is on the wire
the group of its samples, and a column its samples' constructor would refuse is refused alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from relax_slurm.broker.wire import (SCALAR_FIELDS, Packed, decode, encode, group_nbytes,
                                     pack_group)
from relax_slurm.errors import BrokerError
from relax_slurm.samples import ARRAY_FIELDS, OPTIONAL_ARRAY_FIELDS, Sample
from tests.unit.broker.test_wire import assert_same

ARRAYS = (*ARRAY_FIELDS, *OPTIONAL_ARRAY_FIELDS)


def columns(n: int = 4, resp: tuple[int, ...] = (3, 0, 5, 2), **over: Any
            ) -> tuple[dict, dict, dict]:
    """A group's columns as a single-turn worker holds them: token lists, one stamp map and
    one media dict shared by every sample."""
    rng = np.random.default_rng(sum(resp))
    outputs = [rng.integers(0, 1000, r).tolist() for r in resp[:n]]
    stamp = {"worker": 0, "data_state": {"epoch": 0, "index": 7}}
    scalars = {"prompt_id": ["p7"] * n, "group_id": [7] * n, "reward": [1, 0.5, 0.0, 1.0][:n],
               "version": [3] * n, "version_min": [2, 3, 2, 2][:n],
               "version_spans": [[[2, 0, 1], [3, 1, len(o)]] if len(o) > 1 else []
                                 for o in outputs],
               "finish_reason": ["stop", "length", "stop", "stop"][:n],
               "multimodal": [{}] * n, "metadata": [stamp] * n}
    arrays = {"prompt_ids": [[5, 6, 7]] * n, "response_ids": outputs,
              "loss_mask": [[1.0] * len(o) for o in outputs],
              "rollout_logprobs": [rng.standard_normal(len(o)).tolist() for o in outputs],
              "teacher_logprobs": [None] * n, "routed_experts": [None] * n}
    for k, v in over.items():
        (scalars if k in SCALAR_FIELDS else arrays)[k] = v
    return scalars, arrays, {}


def samples_of(scalars: dict, arrays: dict, mm: dict) -> list[Sample]:
    """The same group made the way every other producer makes one."""
    n = len(scalars["prompt_id"])
    return [Sample(**{k: scalars[k][i] for k in SCALAR_FIELDS},
                   **{k: arrays[k][i] for k in ARRAYS if arrays.get(k) is not None},
                   mm_inputs=mm) for i in range(n)]


def outcome(make) -> Any:
    try:
        return make()
    except (ValueError, BrokerError) as e:
        # (numpy's own detail after a 1-D refusal depends on how the values were joined)
        return type(e), str(e).replace("group 0: ", "group: ").split("only):")[0]


def both(scalars: dict, arrays: dict, mm: dict) -> tuple[Any, Any]:
    """The group packed from columns, and made of samples; each put through encode."""
    packed = outcome(lambda: encode("put_group", {}, [pack_group(scalars, arrays, mm)]))
    plain = outcome(lambda: encode("put_group", {}, [samples_of(scalars, arrays, mm)]))
    return packed, plain


def test_a_packed_group_is_on_the_wire_the_group_of_its_samples(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    image = rng.standard_normal((4, 6)).astype(np.float32)
    grid = np.array([[1, 2, 2]], dtype=np.int64)
    cases = [
        columns(),
        columns(teacher_logprobs=[rng.standard_normal(r).astype(np.float32)
                                  for r in (3, 0, 5, 2)],
                routed_experts=[rng.integers(0, 8, 4 * (r + 2)).astype(np.int16)
                                for r in (3, 0, 5, 2)]),
        (*columns(n=2)[:2], {"pixel_values": image, "image_grid_thw": grid}),
        columns(n=1, resp=(0,)),
    ]
    made: list[int] = []
    init = Sample.__post_init__
    for scalars, arrays, mm in cases:
        monkeypatch.setattr(Sample, "__post_init__", lambda s: (made.append(1), init(s))[1])
        packed = pack_group(scalars, arrays, mm)
        frames = [bytes(f) for f in encode("put_group", {}, [packed])]
        assert made == []  # the worker's path makes no Sample
        monkeypatch.undo()
        expected = samples_of(scalars, arrays, mm)
        assert group_nbytes(packed) == group_nbytes(expected)
        [got] = decode(frames)[2]  # type: ignore[misc]
        [kept] = decode(frames, keep_frames=True)[2]  # type: ignore[misc]
        assert isinstance(kept, Packed) and kept.scalars == packed.scalars
        for want, a, b in zip(expected, got, packed):
            for s in (a, b):
                assert_same(want, s)
                assert s.metadata == want.metadata and s.multimodal == want.multimodal
                if want.routed_experts is None:
                    assert s.routed_experts is None
                else:
                    assert s.routed_experts is not None and s.routed_experts.dtype == np.int16
                    np.testing.assert_array_equal(s.routed_experts, want.routed_experts)
                assert s.mm_inputs.keys() == want.mm_inputs.keys()
                for k, v in want.mm_inputs.items():
                    np.testing.assert_array_equal(s.mm_inputs[k], v)
                assert type(s.reward) is float
    # the media every sample shares travels once
    assert len(encode("put_group", {}, [pack_group(*cases[2])])) == 1 + 4 + 2


def _bad_cases() -> list[tuple[str, dict, dict, dict]]:
    s, a, mm = columns()
    spans_over = [*s["version_spans"][:2], [[3, 0, 9]], s["version_spans"][3]]
    return [
        ("a loss mask one short", s, {**a, "loss_mask": [[1.0] * 3, [], [1.0] * 4, [1.0] * 2]},
         mm),
        ("log-probs one long", s,
         {**a, "rollout_logprobs": [[0.0] * 3, [0.0], [0.0] * 5, [0.0] * 2]}, mm),
        ("teacher log-probs of the wrong length", s,
         {**a, "teacher_logprobs": [[0.0] * 3, [], [0.0] * 5, [0.0]]}, mm),
        ("a span past the response", {**s, "version_spans": spans_over}, a, mm),
        ("a span of a version outside the sample's", {**s, "version_min": [2, 3, 2, 3]}, a,
         mm),
        ("a span that is no triple", {**s, "version_spans": [[[3, 0]], [], [], []]}, a, mm),
        ("two bad samples (the first is named)",
         {**s, "version_spans": [[[3, 0, 9]], [], [[3, 0, 9]], []]}, a, mm),
        ("teacher log-probs on some samples only", s,
         {**a, "teacher_logprobs": [[0.0] * 3, None, [0.0] * 5, [0.0] * 2]}, mm),
        ("a 2-D response (lengths that agree)", s,
         {**a, "response_ids": [[[1, 2], [3, 4], [5, 6]], [], [1] * 5, [1, 2]]}, mm),
        ("a media value that is no array", s, a, {"pixel_values": [[0.0]]}),
    ]


@pytest.mark.parametrize("what,scalars,arrays,mm", _bad_cases(),
                         ids=[c[0] for c in _bad_cases()])
def test_a_bad_column_is_refused_as_its_samples_would_be(what, scalars, arrays, mm) -> None:
    packed, plain = both(scalars, arrays, mm)
    assert isinstance(plain, tuple), f"{what}: the samples' own path accepted it"
    assert packed == plain


def test_a_column_without_a_value_per_sample_is_named() -> None:
    scalars, arrays, mm = columns()
    with pytest.raises(BrokerError, match=r"\['reward', 'rollout_logprobs'\] do not hold one"):
        pack_group({**scalars, "reward": [1.0] * 3}, {**arrays, "rollout_logprobs": []}, mm)
