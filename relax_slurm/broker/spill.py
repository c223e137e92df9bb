"""The broker's spill file: an append-only record of its state, so that a broker killed outright
(kill -9, OOM) restarts in place where it stopped: same version, counters, queued groups and
credits in flight, and the same answers to requests it had answered but whose replies were lost.

    RUN_DIR/broker/spill.bin   a sequence of records, each
        "RSP1" | u32 payload bytes | u32 crc32(payload) | payload
        payload = u32 frame count | u64 length of each frame | the frames
    the frames are one broker wire message (wire.py): op "spill", fields
        s      the state's snapshot (every counter, the admission flag) after the change
        add    sequence numbers of groups that entered the queue (the groups ride in the frames)
        rm     sequence numbers of groups that left it (handed to the trainer or dropped as stale)
        who    [client identity, request id] of the request the change answers, with
        reply  its reply's fields and
        taken  the sequence numbers handed out in that reply (get_batch)
        base   true on the first record of a file: the queue is exactly `add`

The server writes a record before it sends a reply that changed the state (`Spill.record` finds
the change by comparing the queue with what the file holds), so whatever a client was told is on
file first. Durability: every record is one unbuffered `write` to the OS, which survives the
broker process dying; with `broker.spill_fsync=true` it is also fsynced (survives the machine
going down; costs a disk flush per request). A record cut short by a crash (a torn tail) fails
its length or CRC check; replay stops before it and the writer truncates it. When the file
outgrows `broker.spill_compact_mb` it is rewritten as one base record of the live state
(written to a temporary file, fsynced, renamed over the old one).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.wire import decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.samples import Group

MAGIC = b"RSP1"
_HEAD = struct.Struct("<4sII")
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")


def pack_record(frames: list[Any]) -> bytes:
    bufs = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    payload = b"".join([_COUNT.pack(len(bufs)), *(_LEN.pack(b.nbytes) for b in bufs), *bufs])
    return _HEAD.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def iter_records(data: bytes) -> Iterator[tuple[int, list[memoryview]]]:
    """(end offset, frames) of each whole record; stops at the first torn or corrupt one."""
    view, pos = memoryview(data), 0
    while pos + _HEAD.size <= len(view):
        magic, size, crc = _HEAD.unpack_from(view, pos)
        start = pos + _HEAD.size
        if magic != MAGIC or start + size > len(view):
            return
        payload = view[start:start + size]
        if zlib.crc32(payload) != crc or size < _COUNT.size:
            return
        (n,) = _COUNT.unpack_from(payload, 0)
        offset = _COUNT.size + n * _LEN.size
        if offset > size:
            return
        frames = []
        for i in range(n):
            (length,) = _LEN.unpack_from(payload, _COUNT.size + i * _LEN.size)
            frames.append(payload[offset:offset + length])
            offset += length
        if offset != size:
            return
        pos = start + size
        yield pos, frames


@dataclass
class Replayed:
    """What a spill file says: the state to continue from and the answers to remember."""
    snapshot: dict[str, Any] | None = None
    queue: dict[int, Group] = field(default_factory=dict)
    answers: list[tuple[bytes, Any, dict[str, Any], list[Group] | None]] = field(
        default_factory=list)
    records: int = 0
    good_bytes: int = 0
    torn_bytes: int = 0


def replay(path: Path) -> Replayed:
    out = Replayed()
    data = path.read_bytes() if path.exists() else b""
    for end, frames in iter_records(data):
        try:
            op, f, groups = decode(frames, keep_frames=True)
        except BrokerError:
            break  # cannot happen for a record whose CRC matched, short of a bug: stop there
        if f.get("base"):
            out.queue.clear()
        for seq, group in zip(f.get("add", []), groups or []):
            out.queue[seq] = group
        taken = [out.queue[s] for s in f.get("taken", []) if s in out.queue]
        for seq in f.get("rm", []):
            out.queue.pop(seq, None)
        out.snapshot = f["s"]
        if f.get("who"):
            identity, rid = f["who"]
            out.answers.append((identity, rid, f["reply"], taken if f.get("taken") else None))
        out.records += 1
        out.good_bytes = end
    out.torn_bytes = len(data) - out.good_bytes
    return out


class Spill:
    def __init__(self, path: Path, fsync: bool = False, compact_bytes: int = 1 << 30,
                 replayed: Replayed | None = None) -> None:
        self.path = path
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._live: dict[int, tuple[int, Group]] = {}  # id(group) -> (seq, group): keeps refs
        self._last: dict[str, Any] | None = None
        self._next_seq = 0
        self._file = None
        if replayed is not None:
            # continue the file after its last whole record (a torn tail is cut off)
            with open(path, "r+b" if path.exists() else "wb") as f:
                f.truncate(replayed.good_bytes)
            for seq, group in replayed.queue.items():
                self._live[id(group)] = (seq, group)
            self._next_seq = max(replayed.queue, default=-1) + 1
            self._last = replayed.snapshot
            self._file = open(path, "ab", buffering=0)
            self.size = replayed.good_bytes
        else:
            self._file = open(path, "wb", buffering=0)
            self.size = 0

    def start(self, state: BrokerState) -> None:
        """A fresh file's base record: the state as it starts (restored counters, maybe)."""
        for g in state.queue:
            if id(g) not in self._live:
                self._live[id(g)] = (self._next_seq, g)
                self._next_seq += 1
        self._write(self._base_fields(state), [g for _, g in self._live.values()])

    def _base_fields(self, state: BrokerState) -> dict[str, Any]:
        self._last = state.snapshot()
        return {"base": True, "s": self._last, "add": [s for s, _ in self._live.values()]}

    def record(self, state: BrokerState, who: tuple[bytes, Any] | None = None,
               reply: dict[str, Any] | None = None, taken: list[Group] | None = None) -> None:
        """Append what changed since the last record (nothing if nothing did)."""
        now = {id(g): g for g in state.queue}
        added = [g for k, g in now.items() if k not in self._live]
        gone = [k for k in self._live if k not in now]
        snap = state.snapshot()
        if not added and not gone and snap == self._last:
            return
        seqs = list(range(self._next_seq, self._next_seq + len(added)))
        self._next_seq += len(added)
        for seq, g in zip(seqs, added):
            self._live[id(g)] = (seq, g)
        fields: dict[str, Any] = {"s": snap, "add": seqs,
                                  "rm": [self._live[k][0] for k in gone]}
        if who is not None and who[1] is not None:
            fields["who"] = list(who)
            fields["reply"] = reply or {}
            if taken:
                fields["taken"] = [self._live[id(g)][0] for g in taken if id(g) in self._live]
        for k in gone:
            del self._live[k]
        self._last = snap
        self._write(fields, added)
        if self.size > self.compact_bytes:
            self.compact(state)

    def compact(self, state: BrokerState) -> None:
        """Rewrite the file as one base record of the live state."""
        tmp = self.path.with_suffix(".tmp")
        data = pack_record(encode("spill", self._base_fields(state),
                                  [g for _, g in self._live.values()]))
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file.close()
        self._file = open(self.path, "ab", buffering=0)
        self.size = len(data)

    def _write(self, fields: dict[str, Any], groups: list[Group]) -> None:
        data = pack_record(encode("spill", fields, groups))
        view = memoryview(data)
        while view:  # an unbuffered write may be partial
            view = view[self._file.write(view):]
        if self.fsync:
            os.fsync(self._file.fileno())
        self.size += len(data)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
