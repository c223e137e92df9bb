"""Read the records of an offline wandb run file (run-ID.wandb) without the wandb service.

The file is a LevelDB-style log: a 7-byte header (':W&B', magic, version), then 32 KiB blocks
of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)
holding serialized `wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024
FILE_HEADER = 7
CHUNK_HEADER = 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, pos, pending = [], FILE_HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # block padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def history_keys(path: Path) -> set[str]:
    keys = set()
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            keys |= {i.key or "/".join(i.nested_key) for i in r.history.item}
    return keys


def config_keys(path: Path) -> set[str]:
    keys = set()
    for r in records(path):
        if r.WhichOneof("record_type") in ("config", "run"):
            cfg = r.config if r.HasField("config") else r.run.config
            keys |= {i.key for i in cfg.update}
    return keys
