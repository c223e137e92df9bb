"""Wire format of broker messages: one msgpack header frame plus raw array frames, columnar per
group.

    frame 0      msgpack map {"op": str, "f": {fields}, "g": [group header, ...] | None}
    frame 1..N   per group, one frame per array field: that field of every sample of the group,
                 concatenated in sample order (raw bytes, C order, the field's dtype)

A group header is a map with three keys, and two optional ones:

    "n"   the number of samples in the group
    "s"   {scalar field: [value of sample 0, ..., value of sample n-1]}, one list per field of
          `SCALAR_FIELDS` that is not in "c"
    "c"   (optional) {scalar field: value}: the fields every sample of the group holds alike,
          sent once (the group's id, its version, the worker's stamp map: in a tiny step's
          put 80% of an 87 KB header was one metadata map repeated 16 times a group). A
          map or list counts as alike only when the samples hold the same object (a worker
          stamps a group's samples with one), a str/int/float/bool/None when type and value
          are equal, so nothing is merged that the sample-by-sample form would tell apart
    "a"   {array field: [dtype.str, frame index, [length of sample 0, ..., of sample n-1]]}
    "m"   (optional) per sample {name: [dtype.str, shape, frame index]}: the N-D processed media
          of `Sample.mm_inputs` (pixel values, grids, audio features). Samples of a group that
          hold the same array object (one prompt's media) reference one frame.

So a step's batch (32 groups x 16 samples x 4-5 arrays) travels in ~150 frames, not ~2500, and
decode does one `np.frombuffer` and one validation per field per group; the per-sample arrays
are slices (views) of that buffer. Only 1-D arrays travel (every field of `Sample` is 1-D);
`encode` rejects anything else with a BrokerError. The required `ARRAY_FIELDS` are always
present, even for an empty group (empty frames). An optional array (`OPTIONAL_ARRAY_FIELDS`,
e.g. the teacher's log-probs) is present for a group only when every sample has it; a group that
mixes samples with and without it is an encode error (the trainer needs it on all samples or
none). `encode` copies each field once (`np.concatenate`) and hands the result to ZMQ as a
buffer (no further copy with `copy=False`); `decode` never copies: the arrays view the received
frames (callers that keep or modify them decide whether to copy). The request id `rid` travels
as an ordinary field.

The broker passes groups through: it decodes a put (`keep_frames=True`), checks it and reads
its scalar fields, and encodes the same groups twice more, into its spill record and into the
trainer's batch. A group decoded so is a `Packed`: the header it came with and its own frames,
checked as `Sample` checks each sample (`samples.check_columns`, on the columns: no sample is
made), which `encode` sends again (frame numbers renumbered, no array copied), so the broker's
two encodes cost a header each. Nothing may change such a group after decoding (the broker
never does; its frames would no longer match). A rollout worker makes the same kind of group
from columns (`pack_group`: no `Sample` made on its side either), so a single-turn group goes
from the engine's answer to the trainer's decode without one.

`decode` raises BrokerError on anything malformed: bad msgpack or header layout, a scalar of the
wrong type, a count of values or lengths that differs from "n", a negative or non-integer
length, a wrong dtype, a frame whose byte size is not sum(lengths) * itemsize, an unknown array
name, a missing required array, a frame index out of range or used twice, an unreferenced frame.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Sequence
from itertools import accumulate, chain
from typing import Any, NamedTuple, Union

import msgpack
import numpy as np

from relax_slurm.errors import BrokerError
from relax_slurm.samples import (ARRAY_FIELDS, OPTIONAL_ARRAY_FIELDS, Group, Sample,
                                 check_columns, samples_of_columns)

Frame = Union[bytes, memoryview]
SCALAR_FIELDS = (
    "prompt_id", "group_id", "reward", "version", "version_min", "version_spans",
    "finish_reason", "multimodal", "metadata",
)
# (a sample's version_spans are a few [version, start, end] triples: msgpack, not a frame;
# Sample checks their contents)
_SCALAR_TYPES: dict[str, type | tuple[type, ...]] = {
    "prompt_id": str, "group_id": int, "reward": (int, float), "version": int,
    "version_min": int, "version_spans": list, "finish_reason": str, "multimodal": dict,
    "metadata": dict,
}
_EXACT_TYPES = {k: frozenset(t if isinstance(t, tuple) else (t,)) for k, t in _SCALAR_TYPES.items()}
_ALL_ARRAYS = {**ARRAY_FIELDS, **OPTIONAL_ARRAY_FIELDS}
_GROUP_KEYS = {"n", "s", "a"}
_OPTIONAL_GROUP_KEYS = {"m", "c"}
_PLAIN = (str, int, float, bool, type(None))
_MM_DTYPES = frozenset(np.dtype(t).str for t in ("<f4", "<f2", "<i8", "<i4", "|u1", "|b1"))


def _pack(obj: Any, what: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise BrokerError(
            f"cannot encode {what} with msgpack: {e}; fields, multimodal and metadata must hold "
            "only str/int/float/bool/None/bytes/list/dict (convert numpy scalars with .item())"
        ) from e


Row = namedtuple("Row", SCALAR_FIELDS)
"""A sample's scalar fields, all the broker reads of it (`Packed.rows`)."""


class Packed(Sequence[Sample]):
    """One group held as its wire header and frames: decoded with `decode(keep_frames=True)`
    (the broker) or made from columns by `pack_group` (a rollout worker), checked as `Sample`
    would check each of its samples (`head` numbers its own frames 0..len(frames)-1), which
    `encode` sends on as they are. The broker reads only its scalar fields (`rows`); its
    samples are made the first time something indexes or iterates it (a test, a tool), never
    on the broker's or the worker's own path: making 512 of them was a third of the broker's
    CPU in a tiny step."""

    def __init__(self, head: dict[str, Any], frames: list[Frame],
                 scalars: dict[str, list[Any]]) -> None:
        self.head = head
        self.frames = frames
        self.scalars = scalars
        """Every scalar field's list of values, the header's "c" spread out."""
        self._samples: list[Sample] | None = None
        self._rows: list[Row] | None = None

    def __len__(self) -> int:
        return self.head["n"]

    def rows(self) -> list[Row]:
        """Each sample's scalar fields as a `Row` (attributes named as `Sample`'s)."""
        if self._rows is None:
            self._rows = list(map(Row._make, zip(*(self.scalars[k] for k in SCALAR_FIELDS))))
        return self._rows

    def samples(self) -> list[Sample]:
        if self._samples is None:  # (checked at decode: this cannot fail)
            head = _renumbered(self.head, lambda i: i + 1)  # frame 0 is a message's header
            self._samples = _samples(_columns("group", head, [b"", *self.frames], set()))
        return self._samples

    def __getitem__(self, i):  # type: ignore[override]
        return self.samples()[i]


def _renumbered(head: dict[str, Any], number: Callable[[int], int]) -> dict[str, Any]:
    """`head` with every frame index i of its arrays and media replaced by number(i)."""
    out = {**head, "a": {k: [dtype, number(i), lengths]
                         for k, (dtype, i, lengths) in head["a"].items()}}
    if "m" in head:
        out["m"] = [{k: [dtype, shape, number(i)] for k, (dtype, shape, i) in refs.items()}
                    for refs in head["m"]]
    return out


def _pass_through(group: Packed, frames: list[Frame]) -> dict[str, Any]:
    base = len(frames)
    frames.extend(group.frames)
    return _renumbered(group.head, lambda i: base + i)


def _keep(head: dict[str, Any], frames: Sequence[Any], scalars: dict[str, list[Any]]
          ) -> Packed:
    """A checked group header and the frames it uses, numbered from 0 in order of use;
    `scalars` its columns with "c" spread out."""
    own: dict[int, int] = {}
    local = _renumbered(head, lambda i: own.setdefault(i, len(own)))
    rewards = [float(r) for r in scalars["reward"]]  # (an int reward is sent on as a float)
    if "reward" in head["s"]:
        local["s"] = {**head["s"], "reward": rewards}
    else:
        local["c"] = {**head["c"], "reward": float(head["c"]["reward"])}
    return Packed(local, [_buffer(frames[i]) for i in own], {**scalars, "reward": rewards})


def _encode_group(gi: int, group: Group, frames: list[Frame]) -> dict[str, Any]:
    if isinstance(group, Packed):
        return _pass_through(group, frames)
    head = _head(f"group {gi}", {k: [getattr(s, k) for s in group] for k in SCALAR_FIELDS},
                 {name: [getattr(s, name) for s in group] for name in _ALL_ARRAYS}, frames)
    if any(s.mm_inputs for s in group):
        head["m"] = _encode_mm(gi, group, frames)
    return head


def pack_group(scalars: dict[str, list[Any]], arrays: dict[str, list[Any] | None],
               mm_inputs: dict[str, np.ndarray] | None = None) -> Packed:
    """A group given as columns, held as the header and frames `encode` sends: what a rollout
    worker puts without making its samples (a tiny step's 512 `Sample`s and their encode were
    ~4.6 ms of the worker's path after generation, this ~2 ms). `scalars` holds each field of
    `SCALAR_FIELDS` as one value per sample, `arrays` each array field as one list or 1-D array
    per sample (an optional field: None, or None for every sample); `mm_inputs` is processed
    media every sample shares (one prompt's). Checked as `Sample`'s constructor checks each
    sample, with the same functions (`samples.check_columns`): a ValueError names the first
    bad sample as the constructor would; what the wire cannot carry is a BrokerError as in
    `encode`."""
    n = len(scalars["prompt_id"])
    short = [k for k in SCALAR_FIELDS if len(scalars[k]) != n]
    short += [k for k, v in arrays.items() if v is not None and len(v) != n]
    if short:
        raise BrokerError(f"group: fields {short} do not hold one value per sample ({n})")
    frames: list[Frame] = []
    scalars = {k: scalars[k] for k in SCALAR_FIELDS}
    head = _head("group", scalars, arrays, frames)
    check_columns(scalars, {k: lengths for k, (_, _, lengths) in head["a"].items()})
    if mm_inputs:
        head["m"] = [_media("group", mm_inputs, frames, {})] * head["n"]
    return Packed(head, frames, scalars)


def _head(where: str, scalars: dict[str, list[Any]], arrays: dict[str, list[Any] | None],
          frames: list[Frame]) -> dict[str, Any]:
    """A group's header without media, each array field's values appended to `frames` as one
    contiguous buffer; `scalars`' rewards become floats in place."""
    scalars["reward"] = [float(r) for r in scalars["reward"]]
    consts = _alike(scalars)
    specs: dict[str, list[Any]] = {}
    for name, dtype in _ALL_ARRAYS.items():
        values = arrays.get(name)
        if name in OPTIONAL_ARRAY_FIELDS:
            have = 0 if values is None else sum(v is not None for v in values)
            if have == 0:
                continue
            if have != len(values):
                raise BrokerError(
                    f"{where}: {have} of {len(values)} samples carry {name}; a group must "
                    "carry it on every sample or on none")
        flat, lengths = _flat(where, name, values, dtype)
        specs[name] = [flat.dtype.str, len(frames), lengths]
        frames.append(flat.data)
    head = {"n": len(scalars["prompt_id"]),
            "s": {k: v for k, v in scalars.items() if k not in consts}, "a": specs}
    if consts:
        head["c"] = consts
    return head


def _flat(where: str, name: str, values: list[Any], dtype: np.dtype
          ) -> tuple[np.ndarray, list[int]]:
    """One array field of a group's samples as one buffer of `dtype` (one copy; a cast where a
    sample holds another dtype, as `Sample`'s constructor casts) and each sample's length."""
    try:
        lengths = [len(v) for v in values]
        if all(type(v) is list for v in values):  # a worker's token lists: no array per sample
            flat = np.fromiter(chain.from_iterable(values), dtype, sum(lengths))
        else:
            flat = (np.concatenate(values, dtype=dtype, casting="unsafe") if values
                    else np.empty(0, dtype))
    except (TypeError, ValueError) as e:
        flat, detail = None, f": {e}"
    else:
        detail = ""
    if flat is None or flat.ndim != 1:
        raise BrokerError(f"{where}: array {name!r} must be 1-D in every sample (the wire "
                          f"format carries 1-D arrays only){detail}")
    return flat, lengths


def _alike(scalars: dict[str, list[Any]]) -> dict[str, Any]:
    """The fields every sample holds alike (see "c" in the module docstring)."""
    out = {}
    for k, column in scalars.items():
        if len(column) < 2:
            continue
        first = column[0]
        if isinstance(first, _PLAIN):
            kind = type(first)
            same = all(type(v) is kind and v == first for v in column)
        else:
            same = all(v is first for v in column)
        if same:
            out[k] = first
    return out


def _encode_mm(gi: int, group: Group, frames: list[Frame]) -> list[dict[str, list]]:
    shared: dict[int, int] = {}  # id(array) -> frame: one prompt's media sent once per group
    return [_media(f"group {gi}", s.mm_inputs, frames, shared) for s in group]


def _media(where: str, mm_inputs: dict[str, Any], frames: list[Frame], shared: dict[int, int]
           ) -> dict[str, list]:
    """One sample's media as header refs; an array not yet in `shared` (id -> frame) appended
    to `frames` as one frame."""
    refs = {}
    for name, arr in mm_inputs.items():
        frame = shared.get(id(arr))
        refs[name] = _mm_spec(where, name, arr, len(frames) if frame is None else frame)
        if frame is None:
            shared[id(arr)] = len(frames)
            frames.append(np.ascontiguousarray(arr).reshape(-1).data)
    return refs


def _mm_spec(where: str, name: str, arr: Any, frame: int) -> list:
    if not isinstance(arr, np.ndarray) or arr.dtype.str not in _MM_DTYPES:
        raise BrokerError(f"{where}: mm_inputs[{name!r}] must be a numpy array of "
                          f"{sorted(_MM_DTYPES)}, got {getattr(arr, 'dtype', type(arr))}")
    return [arr.dtype.str, list(arr.shape), frame]


def group_nbytes(group: Group) -> int:
    """About the bytes `group` takes on the wire: its arrays (a media array its samples share
    counted once), without the small msgpack header."""
    if isinstance(group, Packed):
        return sum(_buffer(f).nbytes for f in group.frames)
    arrays: dict[int, int] = {}
    for s in group:
        for name in _ALL_ARRAYS:
            a = getattr(s, name)
            if a is not None:
                arrays[id(a)] = np.asarray(a).nbytes
        for a in s.mm_inputs.values():
            arrays[id(a)] = getattr(a, "nbytes", 0)
    return sum(arrays.values())


def encode(op: str, fields: dict[str, Any], groups: list[Group] | None = None) -> list[Frame]:
    """Frames for one message: a msgpack header, then per group one frame per array field."""
    frames: list[Frame] = [b""]
    group_headers = None
    if groups is not None:
        group_headers = [_encode_group(gi, g, frames) for gi, g in enumerate(groups)]
    frames[0] = _pack({"op": op, "f": fields, "g": group_headers}, f"message {op!r}")
    return frames


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame (received with copy=False) exposes its bytes as .buffer; bytes/memoryview as-is
    return memoryview(getattr(frame, "buffer", frame))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _decode_array(where: str, name: str, spec: Any, n: int, frames: Sequence[Any],
                  used: set[int]) -> tuple[np.ndarray, list[int]]:
    """One field of one group: the whole buffer (a view of its frame) and each sample's
    length, checked against each other."""
    what = f"{where}, array {name!r}"
    if not (isinstance(spec, list) and len(spec) == 3):
        raise BrokerError(f"{what}: expected [dtype, frame, lengths], got {spec!r}")
    dtype_str, index, lengths = spec
    expected = _ALL_ARRAYS[name]
    if dtype_str != expected.str:
        raise BrokerError(f"{what}: dtype {dtype_str!r}, expected {expected.str!r}")
    if not (isinstance(lengths, list) and len(lengths) == n):
        raise BrokerError(f"{what}: expected a list of {n} lengths (one per sample), got "
                          f"{lengths!r}")
    if not set(map(type, lengths)) <= {int} or min(lengths, default=0) < 0:  # (bool is no int)
        raise BrokerError(f"{what}: lengths must be non-negative integers, got {lengths!r}")
    if not _is_int(index) or not 1 <= index < len(frames) or index in used:
        raise BrokerError(f"{what}: frame index {index!r} is out of range or used twice "
                          f"(message has {len(frames)} frames)")
    used.add(index)
    buf = _buffer(frames[index])
    size = sum(lengths) * expected.itemsize
    if buf.nbytes != size:
        raise BrokerError(f"{what}: frame {index} has {buf.nbytes} bytes, lengths {lengths} "
                          f"need {size}")
    return np.frombuffer(buf, dtype=expected), lengths


def _views(flat: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """Each sample's slice of a field's buffer: views, no copy (np.split does the same with
    more overhead)."""
    ends = accumulate(lengths)
    return [flat[end - length:end] for length, end in zip(lengths, ends)]


def _decode_mm(where: str, refs: Any, n: int, frames: Sequence[Any], used: set[int]
               ) -> list[dict[str, np.ndarray]]:
    """Per sample {name: array view}; a frame may back several samples' arrays (shared)."""
    if not (isinstance(refs, list) and len(refs) == n and all(isinstance(r, dict) for r in refs)):
        raise BrokerError(f"{where}: m must be a list of {n} maps")
    mine: set[int] = set()
    views: dict[tuple, np.ndarray] = {}
    out = []
    for r in refs:
        sample = {}
        for name, spec in r.items():
            what = f"{where}, mm_inputs {name!r}"
            ok = (isinstance(spec, list) and len(spec) == 3 and spec[0] in _MM_DTYPES
                  and isinstance(spec[1], list) and all(_is_int(d) and d >= 0 for d in spec[1])
                  and _is_int(spec[2]) and 1 <= spec[2] < len(frames)
                  and (spec[2] in mine or spec[2] not in used))
            if not ok:
                raise BrokerError(f"{what}: expected [dtype, shape, frame] of an unused frame, "
                                  f"got {spec!r}")
            dtype, shape, index = np.dtype(spec[0]), tuple(spec[1]), spec[2]
            key = (index, dtype.str, shape)
            if key not in views:
                buf = _buffer(frames[index])
                if buf.nbytes != int(np.prod(shape)) * dtype.itemsize:
                    raise BrokerError(f"{what}: frame {index} has {buf.nbytes} bytes, shape "
                                      f"{list(shape)} of {dtype} needs "
                                      f"{int(np.prod(shape)) * dtype.itemsize}")
                views[key] = np.frombuffer(buf, dtype=dtype).reshape(shape)
            mine.add(index)
            sample[name] = views[key]
        out.append(sample)
    used |= mine
    return out


class _Columns(NamedTuple):
    where: str
    n: int
    scalars: dict[str, list[Any]]
    arrays: dict[str, tuple[np.ndarray, list[int]]]
    mm: list[dict[str, np.ndarray]] | None


def _columns(where: str, head: Any, frames: Sequence[Any], used: set[int]) -> _Columns:
    """A group header's layout and types checked, its frames marked used, nothing per sample."""
    if not (isinstance(head, dict)
            and _GROUP_KEYS <= set(head) <= _GROUP_KEYS | _OPTIONAL_GROUP_KEYS):
        raise BrokerError(f"{where}: header must be a map with keys n, s, a (and m, c)")
    n, scalars, specs = head["n"], head["s"], head["a"]
    if not (_is_int(n) and n >= 0):
        raise BrokerError(f"{where}: n must be a non-negative integer, got {n!r}")
    if not isinstance(scalars, dict):
        raise BrokerError(f"{where}: s must be a map of per-sample scalar lists")
    consts = head.get("c", {})
    if not (isinstance(consts, dict) and set(consts) <= set(SCALAR_FIELDS)
            and not set(consts) & set(scalars)):
        raise BrokerError(f"{where}: c must be a map of scalar fields that s does not have, "
                          f"got {consts!r}")
    missing = [k for k in SCALAR_FIELDS if k not in scalars and k not in consts]
    if missing:
        raise BrokerError(f"{where}: scalar fields {missing} are missing")
    for k in SCALAR_FIELDS:
        if k in consts:
            types = {type(consts[k])}
        else:
            column = scalars[k]
            if not (isinstance(column, list) and len(column) == n):
                raise BrokerError(f"{where}: sample field {k!r} must be a list of {n} values")
            # msgpack decodes to exact builtin types, so comparing type sets is an isinstance
            # check (bool, a subclass of int, is rejected as before) done in C for the column
            types = set(map(type, column))
        bad = types - _EXACT_TYPES[k]
        if bad:
            raise BrokerError(f"{where}: sample field {k!r}: unexpected type "
                              f"{' / '.join(sorted(t.__name__ for t in bad))}")
    if not isinstance(specs, dict) or not set(ARRAY_FIELDS) <= set(specs) <= set(_ALL_ARRAYS):
        got = sorted(map(str, specs)) if isinstance(specs, dict) else specs
        raise BrokerError(f"{where}: arrays must be {sorted(ARRAY_FIELDS)}, optionally with "
                          f"{sorted(OPTIONAL_ARRAY_FIELDS)}; got {got!r}")
    arrays = {name: _decode_array(where, name, specs[name], n, frames, used)
              for name in _ALL_ARRAYS if name in specs}
    mm = _decode_mm(where, head["m"], n, frames, used) if "m" in head else None
    # "c" spread out only now that n is backed by what the message carries (each array's n
    # lengths): a header claiming a huge n beside a small "c" must not make us allocate it
    scalars = {**scalars, **{k: [v] * n for k, v in consts.items()}}
    return _Columns(where, n, scalars, arrays, mm)


def _samples(c: _Columns) -> list[Sample]:
    """The group's samples; their arrays view the frames. Checked on the columns by the
    constructor's own checks, then made without running them again per sample."""
    spans = _checked(c)
    columns: dict[str, Sequence[Any]] = {**c.scalars, "version_spans": spans}
    for name, (flat, lengths) in c.arrays.items():
        columns[name] = _views(flat, lengths)
    if c.mm is not None:
        columns["mm_inputs"] = c.mm
    return samples_of_columns(columns)


def _checked(c: _Columns) -> list[list[list[int]]]:
    """What each sample's constructor checks, on the columns; the samples' version_spans."""
    try:
        return check_columns(c.scalars, {k: lengths for k, (_, lengths) in c.arrays.items()})
    except ValueError as e:
        raise BrokerError(f"{c.where}: invalid sample: {e}") from e


def _decode_group(gi: int, head: Any, frames: Sequence[Any], used: set[int],
                  keep_frames: bool = False) -> Group | Packed:
    c = _columns(f"group {gi}", head, frames, used)
    if not keep_frames:
        return _samples(c)
    _checked(c)
    return _keep(head, frames, c.scalars)


def decode(frames: Sequence[Any], keep_frames: bool = False
           ) -> tuple[str, dict[str, Any], list[Group] | list[Packed] | None]:
    """Inverse of `encode`; raises BrokerError on anything malformed. The arrays of the
    returned samples are views of `frames` (no copy). With `keep_frames` each group is a
    `Packed` that `encode` sends on as it came (the broker's pass-through)."""
    if len(frames) < 1:
        raise BrokerError("empty message")
    try:
        header = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise BrokerError(f"message header is not valid msgpack: {e}") from e
    if not isinstance(header, dict) or set(header) != {"op", "f", "g"}:
        raise BrokerError("message header must be a map with keys op, f, g")
    op, fields, group_headers = header["op"], header["f"], header["g"]
    if not isinstance(op, str) or not isinstance(fields, dict):
        raise BrokerError("message header: op must be a string and f a map")
    if group_headers is None:
        if len(frames) != 1:
            raise BrokerError(f"message {op!r} has {len(frames) - 1} array frames but no groups")
        return op, fields, None
    if not isinstance(group_headers, list):
        raise BrokerError(f"message {op!r}: g must be a list of group headers")
    used: set[int] = set()
    groups = [_decode_group(gi, h, frames, used, keep_frames)
              for gi, h in enumerate(group_headers)]
    if len(used) != len(frames) - 1:
        raise BrokerError(f"message {op!r}: {len(frames) - 1 - len(used)} unreferenced frames")
    return op, fields, groups
