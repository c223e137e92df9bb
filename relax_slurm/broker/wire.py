"""Wire format of broker messages: one msgpack header frame plus raw array frames.

    frame 0      msgpack map {"op": str, "f": {fields}, "g": [[sample header, ...], ...] | None}
    frame 1..N   the raw bytes of every array of every sample, in the order the headers name them

A sample header holds the scalar fields of `Sample` and, under "a", one entry per array field:
`[dtype.str, shape, frame index]`. Optional arrays (`OPTIONAL_ARRAY_FIELDS`, e.g. the teacher's
log-probs) appear under "a" only when the sample has them, so a message from a sender that does
not know them still decodes. Arrays are never pickled or copied into the header: on send
they are handed to ZMQ as buffers (zero-copy with `copy=False`), on receive `np.frombuffer`
views the received frame. The request id `rid` travels as an ordinary field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgpack
import numpy as np

from relax_slurm.errors import BrokerError
from relax_slurm.samples import ARRAY_FIELDS, OPTIONAL_ARRAY_FIELDS, Group, Sample

Frame = Union[bytes, memoryview]
SCALAR_FIELDS = (
    "prompt_id", "group_id", "reward", "version", "version_min", "finish_reason",
    "multimodal", "metadata",
)
_SCALAR_TYPES: dict[str, type | tuple[type, ...]] = {
    "prompt_id": str, "group_id": int, "reward": (int, float), "version": int,
    "version_min": int, "finish_reason": str, "multimodal": dict, "metadata": dict,
}
_ALL_ARRAYS = {**ARRAY_FIELDS, **OPTIONAL_ARRAY_FIELDS}


def _pack(obj: Any, what: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise BrokerError(
            f"cannot encode {what} with msgpack: {e}; fields, multimodal and metadata must hold "
            "only str/int/float/bool/None/bytes/list/dict (convert numpy scalars with .item())"
        ) from e


def encode(op: str, fields: dict[str, Any], groups: list[Group] | None = None) -> list[Frame]:
    """Frames for one message; array frames are views of the samples' arrays (no copy)."""
    frames: list[Frame] = [b""]
    group_headers = None
    if groups is not None:
        group_headers = []
        for group in groups:
            sample_headers = []
            for s in group:
                head: dict[str, Any] = {k: getattr(s, k) for k in SCALAR_FIELDS}
                head["reward"] = float(s.reward)
                arrays = {}
                for name, dtype in _ALL_ARRAYS.items():
                    if getattr(s, name) is None:  # an optional array the sample lacks
                        continue
                    # contiguous in the expected dtype: a no-op unless the field was reassigned
                    arr = np.ascontiguousarray(getattr(s, name), dtype=dtype)
                    arrays[name] = [arr.dtype.str, list(arr.shape), len(frames)]
                    frames.append(arr.data)
                head["a"] = arrays
                sample_headers.append(head)
            group_headers.append(sample_headers)
    frames[0] = _pack({"op": op, "f": fields, "g": group_headers}, f"message {op!r}")
    return frames


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame (received with copy=False) exposes its bytes as .buffer; bytes/memoryview as-is
    return memoryview(getattr(frame, "buffer", frame))


def _decode_array(name: str, spec: Any, frames: Sequence[Any], used: set[int]) -> np.ndarray:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise BrokerError(f"array {name!r}: expected [dtype, shape, frame], got {spec!r}")
    dtype_str, shape, index = spec
    expected = _ALL_ARRAYS[name]
    if dtype_str != expected.str:
        raise BrokerError(f"array {name!r}: dtype {dtype_str!r}, expected {expected.str!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise BrokerError(f"array {name!r}: bad shape {shape!r}")
    if not isinstance(index, int) or not 1 <= index < len(frames) or index in used:
        raise BrokerError(f"array {name!r}: frame index {index!r} is missing or reused "
                          f"(message has {len(frames)} frames)")
    used.add(index)
    buf = _buffer(frames[index])
    size = int(np.prod(shape, dtype=np.int64)) * expected.itemsize
    if buf.nbytes != size:
        raise BrokerError(f"array {name!r}: frame {index} has {buf.nbytes} bytes, "
                          f"shape {shape} needs {size}")
    return np.frombuffer(buf, dtype=expected).reshape(shape)


def _decode_sample(head: Any, frames: Sequence[Any], used: set[int]) -> Sample:
    if not isinstance(head, dict):
        raise BrokerError(f"sample header must be a map, got {type(head).__name__}")
    missing = [k for k in (*SCALAR_FIELDS, "a") if k not in head]
    if missing:
        raise BrokerError(f"sample header lacks {missing}")
    for k, types in _SCALAR_TYPES.items():
        if not isinstance(head[k], types) or isinstance(head[k], bool):
            raise BrokerError(f"sample field {k!r}: unexpected type {type(head[k]).__name__}")
    specs = head["a"]
    if not isinstance(specs, dict) or not set(ARRAY_FIELDS) <= set(specs) <= set(_ALL_ARRAYS):
        raise BrokerError(f"sample arrays must be {sorted(ARRAY_FIELDS)}, optionally with "
                          f"{sorted(OPTIONAL_ARRAY_FIELDS)}")
    arrays = {name: _decode_array(name, specs[name], frames, used) for name in _ALL_ARRAYS
              if name in specs}
    try:
        return Sample(**{k: head[k] for k in SCALAR_FIELDS}, **arrays)
    except ValueError as e:
        raise BrokerError(f"invalid sample: {e}") from e


def decode(frames: Sequence[Any]) -> tuple[str, dict[str, Any], list[Group] | None]:
    """Inverse of `encode`; raises BrokerError on anything malformed."""
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
    if not isinstance(group_headers, list) or not all(isinstance(g, list) for g in group_headers):
        raise BrokerError(f"message {op!r}: g must be a list of lists of sample headers")
    used: set[int] = set()
    groups = [[_decode_sample(h, frames, used) for h in g] for g in group_headers]
    if len(used) != len(frames) - 1:
        raise BrokerError(f"message {op!r}: {len(frames) - 1 - len(used)} unreferenced frames")
    return op, fields, groups
