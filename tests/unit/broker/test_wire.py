"""Wire format: round trips and rejection of malformed messages."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable
from unittest import mock

import msgpack
import numpy as np
import pytest

from relax_slurm.broker import wire
from relax_slurm.broker.wire import SCALAR_FIELDS, decode, encode, group_nbytes
from relax_slurm.errors import BrokerError
from relax_slurm.samples import ARRAY_FIELDS, Sample, samples_of_columns


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
    for name in SCALAR_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    for name, dtype in ARRAY_FIELDS.items():
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    if a.teacher_logprobs is None:
        assert b.teacher_logprobs is None
    else:
        assert b.teacher_logprobs is not None and b.teacher_logprobs.dtype == np.float32
        np.testing.assert_array_equal(a.teacher_logprobs, b.teacher_logprobs)


def assert_equal(a: Sample, b: Sample) -> None:
    """Every field of two samples equal: values, arrays' dtypes and contents, media."""
    for f in dataclasses.fields(Sample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "mm_inputs":
            assert x.keys() == y.keys()
            x, y = list(x.values()), list(y.values())
        else:
            x, y = [x], [y]
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                assert isinstance(u, np.ndarray) and isinstance(v, np.ndarray), f.name
                assert u.dtype == v.dtype and u.flags.c_contiguous == v.flags.c_contiguous
                np.testing.assert_array_equal(u, v)
            else:
                assert type(u) is type(v) and u == v, f.name


def _constructed(c: Any) -> list[Sample]:
    """A group's samples each made by `Sample`'s constructor, with its own checks: the way
    `decode` made them before it checked the columns once and made them without (the
    reference the faster way must equal, refusals included)."""
    columns = {**c.scalars, **{k: wire._views(flat, lengths)
                               for k, (flat, lengths) in c.arrays.items()}}
    if c.mm is not None:
        columns["mm_inputs"] = c.mm
    try:
        return [Sample(**dict(zip(columns, row))) for row in zip(*columns.values())]
    except ValueError as e:
        raise BrokerError(f"{c.where}: invalid sample: {e}") from e


def decode_both(frames: list) -> Any:
    """`decode` the trainer's way, the broker's (`keep_frames`: each sample checked on the
    group's columns, none made) and with each sample made by its constructor: the same
    refusal every way, or the same samples."""
    ways = {"plain": lambda: decode(frames), "kept": lambda: decode(frames, keep_frames=True)}
    answers = {}
    for way, run in {**ways, "constructed": ways["plain"]}.items():
        with mock.patch.object(wire, "_samples", _constructed if way == "constructed"
                               else wire._samples):
            try:
                answers[way] = run()
            except BrokerError as e:
                answers[way] = e
    plain, kept, constructed = answers.values()
    if any(isinstance(a, BrokerError) for a in answers.values()):
        assert str(plain) == str(kept) == str(constructed)
        raise plain
    for a, b, c in zip(plain[2] or [], kept[2] or [], constructed[2] or []):
        assert len(a) == len(b) == len(c)
        for x, y, z in zip(a, b, c):
            assert_same(x, y)
            assert_equal(x, z)
    return plain


def header_of(frames: list) -> dict:
    return msgpack.unpackb(frames[0], strict_map_key=False)


def test_round_trip_all_fields() -> None:
    groups = [[make_sample(), make_sample(5, 0, prompt_id="p2", multimodal={}, metadata={},
                                          reward=1)],
              [make_sample(0, 2, group_id=8)], []]
    frames = encode("put_group", {"rid": 3, "x": [1, 2]}, groups)
    assert len(frames) == 1 + 4 * 3  # one frame per array field per group, even an empty one
    op, fields, out = decode_both(frames)
    assert op == "put_group" and fields == {"rid": 3, "x": [1, 2]}
    assert out is not None and [len(g) for g in out] == [2, 1, 0]
    for ga, gb in zip(groups, out):
        for a, b in zip(ga, gb):
            assert_same(a, b)
    assert isinstance(out[0][1].reward, float)


def test_layout_is_columnar_per_group() -> None:
    group = [make_sample(3, 4), make_sample(5, 2, prompt_id="p2", version=4)]
    frames = encode("put_group", {}, [group])
    g = header_of(frames)["g"][0]
    assert set(g) == {"n", "s", "a", "c"} and g["n"] == 2
    assert g["s"]["prompt_id"] == ["p1", "p2"] and g["s"]["version"] == [3, 4]
    # what both samples hold alike goes once; maps held as two equal objects go per sample
    assert g["c"] == {"group_id": 7, "reward": 0.5, "version_min": 2, "finish_reason": "length"}
    assert len(g["s"]["metadata"]) == 2 and set(g["s"]) | set(g["c"]) == set(SCALAR_FIELDS)
    assert g["a"]["prompt_ids"] == ["<i8", 1, [3, 5]]
    assert g["a"]["response_ids"] == ["<i8", 2, [4, 2]]
    assert g["a"]["loss_mask"] == ["<f4", 3, [4, 2]]
    assert "teacher_logprobs" not in g["a"]
    np.testing.assert_array_equal(np.frombuffer(frames[1], np.int64),
                                  np.concatenate([s.prompt_ids for s in group]))


def test_decoded_arrays_are_views_of_the_frame() -> None:
    group = [make_sample(3, 4), make_sample(5, 2)]
    frames = [bytes(f) if i == 0 else bytearray(f) for i, f in enumerate(encode("g", {}, [group]))]
    _, _, out = decode_both(frames)
    assert out is not None
    a, b = out[0]
    flat = np.frombuffer(frames[1], np.int64)
    assert np.shares_memory(a.prompt_ids, flat) and np.shares_memory(b.prompt_ids, flat)
    assert not np.shares_memory(a.prompt_ids, b.prompt_ids)
    assert a.prompt_ids.flags.writeable  # a writable received frame gives writable arrays
    b.prompt_ids[:] = -1  # writing one sample's slice leaves its neighbour alone
    np.testing.assert_array_equal(a.prompt_ids, group[0].prompt_ids)


def test_reassigned_fields_are_cast_to_the_wire_dtype() -> None:
    s = make_sample()
    s.loss_mask = [1, 0, 1, 1]  # type: ignore[assignment]
    _, _, out = decode(encode("g", {}, [[s]]))
    assert out is not None and out[0][0].loss_mask.dtype == np.float32
    np.testing.assert_array_equal(out[0][0].loss_mask, [1, 0, 1, 1])


def test_only_1d_arrays_are_encoded() -> None:
    s = make_sample()
    s.prompt_ids = np.zeros((2, 3), np.int64)
    with pytest.raises(BrokerError, match="1-D"):
        encode("g", {}, [[s]])
    s.prompt_ids = np.int64(3)  # type: ignore[assignment]
    with pytest.raises(BrokerError, match="1-D"):
        encode("g", {}, [[s]])


def test_no_groups() -> None:
    assert decode(encode("stats", {})) == ("stats", {}, None)
    assert decode(encode("get", {}, [])) == ("get", {}, [])


def test_unencodable_metadata_names_the_fix() -> None:
    with pytest.raises(BrokerError, match="numpy scalars"):
        encode("put_group", {}, [[make_sample(metadata={"x": object()})]])


def _tamper(mutate: Callable[[dict, list], Any], group: list[Sample] | None = None) -> list:
    """Frames of a valid two-sample group after `mutate(group header, frames)`."""
    group = group or [make_sample(), make_sample(5, 2, prompt_id="p2")]
    frames = encode("put_group", {}, [group])
    header = header_of(frames)
    g = header["g"][0]
    for k, v in g.pop("c", {}).items():  # the fields sent once, per sample again (also valid)
        g["s"][k] = [v] * g["n"]
    mutate(g, frames)
    frames[0] = msgpack.packb(header)
    return frames


def _set(path: tuple, value: Any) -> Callable[[dict, list], None]:
    def mutate(g: dict, frames: list) -> None:
        *head, last = path
        for key in head:
            g = g[key]
        g[last] = value
    return mutate


MALFORMED = {
    "empty": [],
    "garbage": [b"\xc1garbage"],
    "not a map": [msgpack.packb([1, 2])],
    "op not str": [msgpack.packb({"op": 1, "f": {}, "g": None})],
    "frames without groups": [msgpack.packb({"op": "x", "f": {}, "g": None}), b"extra"],
    "g not a list": [msgpack.packb({"op": "x", "f": {}, "g": {"a": 1}})],
    "group not a map": [msgpack.packb({"op": "x", "f": {}, "g": [[{"a": 1}]]})],
    "group extra key": _tamper(_set(("x",), 1)),
    "group lacks n": _tamper(lambda g, f: g.pop("n")),
    "n negative": _tamper(_set(("n",), -1)),
    "n bool": _tamper(_set(("n",), True)),
    "n too large": _tamper(_set(("n",), 3)),
    "scalar missing": _tamper(lambda g, f: g["s"].pop("version")),
    "scalar wrong type": _tamper(_set(("s", "group_id"), [7, "seven"])),
    "scalar bool": _tamper(_set(("s", "version"), [3, True])),
    "scalar column short": _tamper(_set(("s", "reward"), [0.5])),
    "scalar column not list": _tamper(_set(("s", "reward"), 0.5)),
    "alike not a map": _tamper(_set(("c",), [1])),
    "alike unknown field": _tamper(_set(("c",), {"bogus": 1})),
    "alike also per sample": _tamper(_set(("c",), {"version": 3})),
    "alike wrong type": _tamper(lambda g, f: g.update(c={"version": True},
                                                      s={**g["s"], "version": None})
                                or g["s"].pop("version")),
    "array missing": _tamper(lambda g, f: g["a"].pop("loss_mask")),
    "array unknown": _tamper(_set(("a", "bogus"), ["<f4", 4, [4, 2]])),
    "spec not a triple": _tamper(_set(("a", "loss_mask"), ["<f4", 3])),
    "wrong dtype": _tamper(_set(("a", "loss_mask", 0), "<f8")),
    "wrong byte size": _tamper(lambda g, f: f.__setitem__(3, bytes(f[3])[:-4])),
    "lengths too few": _tamper(_set(("a", "loss_mask", 2), [6])),
    "lengths too many": _tamper(_set(("a", "loss_mask", 2), [4, 2, 0])),
    "lengths not a list": _tamper(_set(("a", "loss_mask", 2), 6)),
    "negative length": _tamper(_set(("a", "loss_mask", 2), [-1, 7])),
    "float length": _tamper(_set(("a", "loss_mask", 2), [4.0, 2])),
    "lengths disagree with frame": _tamper(_set(("a", "loss_mask", 2), [4, 3])),
    "frame out of range": _tamper(_set(("a", "loss_mask", 1), 99)),
    "frame zero (the header)": _tamper(_set(("a", "loss_mask", 1), 0)),
    "frame not int": _tamper(_set(("a", "loss_mask", 1), "3")),
    "frame missing": _tamper(lambda g, f: f.pop()),
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_raises_broker_error(frames: list) -> None:
    with pytest.raises(BrokerError):
        decode_both(frames)


def test_wrong_dtype_is_named() -> None:
    with pytest.raises(BrokerError, match=r"group 0, array 'loss_mask': dtype '<f8'"):
        decode_both(MALFORMED["wrong dtype"])


def test_wrong_byte_size_is_named() -> None:
    with pytest.raises(BrokerError, match=r"frame 3 has 20 bytes, lengths \[4, 2\] need 24"):
        decode_both(MALFORMED["wrong byte size"])


def test_length_count_must_match_the_group() -> None:
    for case in ("lengths too few", "lengths too many"):
        with pytest.raises(BrokerError, match=r"expected a list of 2 lengths"):
            decode_both(MALFORMED[case])


def test_negative_length_rejected() -> None:
    # [-1, 7] sums to the frame's 6 elements: only the sign check catches it
    with pytest.raises(BrokerError, match="non-negative"):
        decode_both(MALFORMED["negative length"])


def test_frame_referenced_twice() -> None:
    # rollout_logprobs names loss_mask's frame (same dtype and lengths, so only the reuse check
    # can catch it); its own frame would be left over
    frames = _tamper(_set(("a", "rollout_logprobs", 1), 3))
    with pytest.raises(BrokerError, match="used twice"):
        decode_both(frames)


def test_unreferenced_frame() -> None:
    with pytest.raises(BrokerError, match="1 unreferenced frames"):
        decode_both(_tamper(lambda g, f: f.append(b"x")))
    # a frame dropped from the header but kept in the message is also unreferenced
    frames = _tamper(lambda g, f: g["a"].pop("teacher_logprobs"),
                     [make_sample(teacher_logprobs=np.zeros(4))])
    with pytest.raises(BrokerError, match="1 unreferenced frames"):
        decode_both(frames)


def test_inconsistent_lengths_rejected() -> None:
    # lengths that pass the frame checks but break Sample's own length invariant
    def mutate(g: dict, f: list) -> None:
        g["a"]["loss_mask"][2] = [3, 2]
        f[3] = np.ones(5, np.float32).tobytes()
    with pytest.raises(BrokerError, match="must match"):
        decode_both(_tamper(mutate))


def test_group_with_teacher_logprobs_round_trips() -> None:
    group = [make_sample(teacher_logprobs=np.array([-0.1, -0.2, -0.3, -0.4])),
             make_sample(5, 2, prompt_id="p2", teacher_logprobs=np.float32([-1, -2]))]
    plain = [make_sample(group_id=9)]
    frames = encode("put_group", {}, [group, plain])
    assert len(frames) == 1 + 5 + 4  # the optional array only for the group that has it
    assert header_of(frames)["g"][0]["a"]["teacher_logprobs"] == ["<f4", 5, [4, 2]]
    _, _, out = decode_both(frames)
    assert out is not None
    for a, b in zip(group + plain, out[0] + out[1]):
        assert_same(a, b)
    assert out[1][0].teacher_logprobs is None
    np.testing.assert_array_equal(out[0][1].teacher_logprobs, np.float32([-1, -2]))


def test_group_mixing_teacher_and_none_is_an_encode_error() -> None:
    mixed = [make_sample(teacher_logprobs=np.zeros(4)), make_sample(prompt_id="p2")]
    with pytest.raises(BrokerError, match="1 of 2 samples carry teacher_logprobs"):
        encode("put_group", {}, [[make_sample()], mixed])


def test_bad_teacher_logprobs_are_rejected() -> None:
    with pytest.raises(ValueError, match="teacher_logprobs"):
        make_sample(teacher_logprobs=np.zeros(3))  # 4 response tokens
    with_teacher = [make_sample(teacher_logprobs=np.zeros(4))]
    with pytest.raises(BrokerError, match="teacher_logprobs"):
        decode_both(_tamper(_set(("a", "teacher_logprobs", 0), "<f8"), with_teacher))
    with pytest.raises(BrokerError, match="teacher_logprobs.*must match"):
        decode_both(_tamper(lambda g, f: (g["a"]["teacher_logprobs"].__setitem__(2, [3]),
                                          f.__setitem__(5, bytes(12))), with_teacher))


def test_mm_inputs_round_trip_shared_per_group() -> None:
    pixels = np.random.default_rng(0).standard_normal((16, 1176)).astype(np.float32)
    grid = np.array([[1, 4, 4]], dtype=np.int64)
    group = [make_sample(mm_inputs={"pixel_values": pixels, "image_grid_thw": grid})
             for _ in range(4)]
    frames = encode("put", {}, [group, [make_sample()]])
    # 4 arrays + 2 media frames for the first group (shared by its 4 samples), 4 for the second
    assert len(frames) == 1 + 4 + 2 + 4
    _, _, (back, text) = decode_both(frames)
    for s in back:
        np.testing.assert_array_equal(s.mm_inputs["pixel_values"], pixels)
        assert s.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert back[0].mm_inputs["pixel_values"] is back[3].mm_inputs["pixel_values"]
    assert text[0].mm_inputs == {}
    # re-encoding what was decoded (the broker hands groups on) keeps the sharing
    assert len(encode("batch", {}, [back])) == 1 + 4 + 2
    # the size a put's byte cap counts: the arrays as sent, shared media once
    sent = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames[1:7])
    assert group_nbytes(group) == sent == group_nbytes(back)


def test_mm_inputs_bad() -> None:
    with pytest.raises(BrokerError, match="must be a numpy array"):
        encode("put", {}, [[make_sample(mm_inputs={"x": [1, 2]})]])
    frames = encode("put", {}, [[make_sample(mm_inputs={"x": np.zeros((2, 3), np.float32)})]])
    frames[-1] = b"\0" * 8
    with pytest.raises(BrokerError, match=r"shape \[2, 3\].*needs 24"):
        decode_both(frames)


def test_version_spans_round_trip_and_malformed_ones_are_refused() -> None:
    spans = [[2, 0, 3], [3, 3, 4]]  # a sync after 3 tokens: the 4th came from version 3
    frames = encode("put_group", {}, [[make_sample(version_spans=spans), make_sample()]])
    _, _, [[a, b]] = decode_both(frames)
    assert a.version_spans == spans and b.version_spans == [] and a.multi_version
    head = header_of(frames)
    for bad in ([[2, 0, 3], [3, 2, 4]],  # overlapping
                [[2, 0, 5]],  # past the 4 response tokens
                [[1, 0, 4]],  # older than version_min=2
                [[2, 0]],  # not a triple
                [[2, 1, 1]]):  # empty
        head["g"][0]["s"]["version_spans"][0] = bad
        with pytest.raises(BrokerError, match="version_spans"):
            decode_both([msgpack.packb(head, use_bin_type=True), *frames[1:]])
    head["g"][0]["s"]["version_spans"] = [{}, []]
    with pytest.raises(BrokerError, match="version_spans"):
        decode_both([msgpack.packb(head, use_bin_type=True), *frames[1:]])


def test_decoded_samples_are_made_once_from_checked_columns(monkeypatch) -> None:
    """The trainer's decode checks a group on its columns and makes each sample without its
    constructor (whose per-sample casts and checks cost ~6 us a sample, 3 ms a tiny batch),
    and yet holds what the constructor would: spans as fresh int lists, one per sample, even
    where the header sent them once for the group."""
    spans = [[2, 0, 3], [3, 3, 4]]
    frames = _tamper(lambda g, f: g["s"].update(version_spans=[[[2.0, 0, 3], [3, 3, 4]]] * 2),
                     [make_sample(version_spans=spans), make_sample(version_spans=spans)])
    head = header_of(frames)
    head["g"][0]["c"] = {"version_spans": head["g"][0]["s"].pop("version_spans")[0]}
    frames[0] = msgpack.packb(head)
    made: list[int] = []
    init = Sample.__post_init__
    monkeypatch.setattr(Sample, "__post_init__", lambda s: (made.append(1), init(s))[1])
    [[a, b]] = decode(frames)[2]  # type: ignore[misc]
    assert made == []
    monkeypatch.undo()
    assert a.version_spans == b.version_spans == spans and a.version_spans is not b.version_spans
    assert all(type(x) is int for span in a.version_spans for x in span)
    assert a.mm_inputs == {} and a.mm_inputs is not b.mm_inputs
    assert a.teacher_logprobs is None and a.routed_experts is None
    a.version_spans.append([3, 4, 4])
    assert b.version_spans == spans
    with pytest.raises(TypeError, match="required"):
        samples_of_columns({"prompt_id": ["p"]})
    # a column the samples would carry as a stray attribute, outside every field's checks
    with pytest.raises(TypeError, match=r"\['rewrd'\] name no Sample field"):
        samples_of_columns({**{k: [getattr(a, k)] for k in vars(a)}, "rewrd": [1.0]})


def test_the_broker_sends_a_received_group_on_as_it_came() -> None:
    """decode(keep_frames=True) then encode: the same samples, renumbered frames that are the
    received ones (no array copied), media shared across samples still sent once, and plain
    groups mixed in encoded as usual."""
    pixels, grid = np.arange(12, dtype=np.float32).reshape(3, 4), np.int64([[1, 2, 3]])
    media = [make_sample(mm_inputs={"pixel_values": pixels, "grid": grid},
                         teacher_logprobs=np.zeros(4)) for _ in range(2)]
    sent = [[make_sample(group_id=1), make_sample(6, 2, group_id=1, reward=1)], media]
    received = decode(encode("put_group", {"rid": 1}, sent), keep_frames=True)[2]
    assert received is not None
    plain = [make_sample(group_id=9)]
    frames = encode("ok", {"rid": 2}, [plain, received[1], received[0]])
    out = decode(frames)[2]
    assert out is not None and [len(g) for g in out] == [1, 2, 2]
    for a, b in zip(plain + media + sent[0], [s for g in out for s in g]):
        assert_same(a, b)
    for s in out[1]:
        np.testing.assert_array_equal(s.mm_inputs["pixel_values"], pixels)
    assert out[1][0].mm_inputs["pixel_values"].base is out[1][1].mm_inputs["pixel_values"].base
    assert len(frames) == 1 + 4 + (5 + 2) + 4  # each group's frames exactly once
    for group, mine in ((received[1], frames[5:12]), (received[0], frames[12:])):
        assert [bytes(f) for f in mine] == [bytes(f) for f in group.frames]
        assert all(np.shares_memory(np.frombuffer(f, np.uint8), np.frombuffer(g, np.uint8))
                   for f, g in zip(mine, group.frames) if len(f))
    # an ordinary decode gives plain lists, which encode reads sample by sample
    assert type(decode(frames)[2][0]) is list


def test_what_a_groups_samples_hold_alike_travels_once() -> None:
    """A worker stamps a group's samples with one metadata map: it is sent once (the put's
    header shrinks by that much) and every decoded sample holds it; values that only compare
    equal (1 and True, 1 and 1.0, two equal maps) stay per sample, so nothing decodes
    differently from the sample-by-sample form."""
    stamp = {"worker": 0, "data_state": {"epoch": 0, "index": 5, "num_rows": 5000}}
    shared = [make_sample(5, 2, prompt_id=f"p{i}", metadata=stamp) for i in range(16)]
    apart = [make_sample(5, 2, prompt_id=f"p{i}", metadata=dict(stamp)) for i in range(16)]
    one, many = encode("put_group", {}, [shared]), encode("put_group", {}, [apart])
    assert header_of(one)["g"][0]["c"]["metadata"] == stamp
    assert "metadata" in header_of(many)["g"][0]["s"]
    assert len(one[0]) < len(many[0]) - 15 * len(msgpack.packb(stamp))
    for frames, sent in ((one, shared), (many, apart)):
        [got] = decode_both(frames)[2]
        for a, b in zip(sent, got):
            assert_same(a, b)
    kept = decode(one, keep_frames=True)[2][0]
    assert kept.scalars["metadata"] == [stamp] * 16 and kept.rows()[3].prompt_id == "p3"
    # equal but of another type: sent per sample, so the bool is refused as it always was
    frames = encode("g", {}, [[make_sample(), make_sample(version=True)]])
    assert header_of(frames)["g"][0]["s"]["version"] == [3, True]
    with pytest.raises(BrokerError, match="'version': unexpected type bool"):
        decode_both(frames)


def test_a_group_with_two_bad_samples_is_refused_for_the_first_both_ways() -> None:
    """The columnar check (the broker's) meets a group's faults in the order the constructors
    (the trainer's decode) do: sample 0's spans before sample 1's lengths."""
    def mutate(g: dict, f: list) -> None:
        g["s"]["version_spans"] = [[[2, 0, 5]], []]  # past sample 0's 4 response tokens
        g["a"]["loss_mask"][2] = [4, 1]  # sample 1 has 2 response tokens
        f[3] = np.ones(5, np.float32).tobytes()
    with pytest.raises(BrokerError, match="sample p1/7: version_spans"):
        decode_both(_tamper(mutate))


def test_a_huge_n_beside_shared_fields_is_refused_before_anything_is_spread() -> None:
    """n is only believed once the message backs it (each array's n lengths): a header that
    claims 2**40 samples and sends every scalar field once in "c" is refused, not spread into
    lists of 2**40 entries (a MemoryError, or the broker killed, on the old order)."""
    def mutate(g: dict, f: list) -> None:
        g["c"] = {k: column[0] for k, column in g["s"].items()}
        g["s"] = {}
        g["n"] = 2**40
    with pytest.raises(BrokerError, match="expected a list of 1099511627776 lengths"):
        decode_both(_tamper(mutate))
