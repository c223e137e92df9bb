"""Wire format: round trips and rejection of malformed messages."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from relax_slurm.broker.wire import decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.samples import ARRAY_FIELDS, Sample


def make_sample(n_prompt: int = 3, n_resp: int = 4, **kw: object) -> Sample:
    rng = np.random.default_rng(n_prompt * 31 + n_resp)
    args = dict(
        prompt_id="p1", group_id=7, prompt_ids=np.arange(n_prompt),
        response_ids=rng.integers(0, 1000, n_resp), loss_mask=np.ones(n_resp),
        rollout_logprobs=rng.standard_normal(n_resp).astype(np.float32), reward=0.5,
        version=3, version_min=2, finish_reason="length",
        multimodal={"images": ["run/mm/0.npy"], "sizes": [[224, 224]]},
        metadata={"label": "42", "turns": [{"tool": "python", "ok": True}], 5: None},
    )
    args.update(kw)
    return Sample(**args)  # type: ignore[arg-type]


def assert_same(a: Sample, b: Sample) -> None:
    for name in ("prompt_id", "group_id", "reward", "version", "version_min", "finish_reason",
                 "multimodal", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    for name, dtype in ARRAY_FIELDS.items():
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_round_trip_all_fields() -> None:
    groups = [[make_sample(), make_sample(5, 0, prompt_id="p2", multimodal={}, metadata={})],
              [make_sample(0, 2, group_id=8)], []]
    frames = encode("put_group", {"rid": 3, "x": [1, 2]}, groups)
    assert len(frames) == 1 + 4 * 3
    op, fields, out = decode(frames)
    assert op == "put_group" and fields == {"rid": 3, "x": [1, 2]}
    assert out is not None and [len(g) for g in out] == [2, 1, 0]
    for ga, gb in zip(groups, out):
        for a, b in zip(ga, gb):
            assert_same(a, b)


def test_arrays_are_sent_without_copy() -> None:
    s = make_sample()
    frames = encode("put_group", {}, [[s]])
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], np.int64), s.prompt_ids)


def test_no_groups() -> None:
    assert decode(encode("stats", {})) == ("stats", {}, None)


def test_unencodable_metadata_names_the_fix() -> None:
    with pytest.raises(BrokerError, match="numpy scalars"):
        encode("put_group", {}, [[make_sample(metadata={"x": object()})]])


def _tamper(mutate: object) -> list:
    frames = encode("put_group", {}, [[make_sample()]])
    header = msgpack.unpackb(frames[0], strict_map_key=False)
    mutate(header, frames)  # type: ignore[operator]
    frames[0] = msgpack.packb(header)
    return frames


@pytest.mark.parametrize("frames", [
    [],
    [b"\xc1garbage"],
    [msgpack.packb([1, 2])],
    [msgpack.packb({"op": 1, "f": {}, "g": None})],
    [msgpack.packb({"op": "x", "f": {}, "g": None}), b"extra"],
    [msgpack.packb({"op": "x", "f": {}, "g": [{"a": 1}]})],
    _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("loss_mask", ["<f8", [4], 3])),
    _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("loss_mask", ["<f4", [5], 3])),
    _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("loss_mask", ["<f4", [4], 99])),
    _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("loss_mask", ["<f4", [4], 1])),
    _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("loss_mask", ["<f4", [-1], 3])),
    _tamper(lambda h, f: h["g"][0][0]["a"].pop("loss_mask")),
    _tamper(lambda h, f: h["g"][0][0].pop("version")),
    _tamper(lambda h, f: h["g"][0][0].__setitem__("group_id", "seven")),
    _tamper(lambda h, f: f.pop()),
    _tamper(lambda h, f: f.append(b"x")),
], ids=lambda f: str(len(f)))
def test_malformed_raises_broker_error(frames: list) -> None:
    with pytest.raises(BrokerError):
        decode(frames)


def test_inconsistent_lengths_rejected() -> None:
    # a header that passes frame checks but breaks Sample's own length invariant
    frames = _tamper(lambda h, f: (h["g"][0][0]["a"].__setitem__("loss_mask", ["<f4", [3], 3]),
                                   f.__setitem__(3, np.ones(3, np.float32).tobytes())))
    with pytest.raises(BrokerError, match="must match"):
        decode(frames)


def test_teacher_logprobs_travel_when_set_and_old_messages_still_decode() -> None:
    with_teacher = make_sample(teacher_logprobs=np.array([-0.1, -0.2, -0.3, -0.4]))
    without = make_sample(prompt_id="p2")
    frames = encode("put_group", {}, [[with_teacher, without]])
    assert len(frames) == 1 + 4 + 1 + 4  # the optional array only where it is set
    _, _, out = decode(frames)
    assert out is not None
    a, b = out[0]
    assert a.teacher_logprobs is not None and a.teacher_logprobs.dtype == np.float32
    np.testing.assert_array_equal(a.teacher_logprobs, np.float32([-0.1, -0.2, -0.3, -0.4]))
    assert b.teacher_logprobs is None
    # a header written before the field existed (no "teacher_logprobs" under "a") decodes
    old = _tamper(lambda h, f: None)
    assert "teacher_logprobs" not in msgpack.unpackb(old[0], strict_map_key=False)["g"][0][0]["a"]
    assert decode(old)[2][0][0].teacher_logprobs is None


def test_bad_teacher_logprobs_are_rejected() -> None:
    with pytest.raises(ValueError, match="teacher_logprobs"):
        make_sample(teacher_logprobs=np.zeros(3))  # 4 response tokens
    frames = encode("put_group", {}, [[make_sample(teacher_logprobs=np.zeros(4))]])
    header = msgpack.unpackb(frames[0], strict_map_key=False)
    header["g"][0][0]["a"]["teacher_logprobs"][0] = "<f8"
    frames[0] = msgpack.packb(header)
    with pytest.raises(BrokerError, match="teacher_logprobs"):
        decode(frames)
    unknown = _tamper(lambda h, f: h["g"][0][0]["a"].__setitem__("bogus", ["<f4", [4], 4]))
    with pytest.raises(BrokerError, match="optionally"):
        decode(unknown)
