"""Where each rollout worker is in its dataset, for exact resume: one record and one rule for the
three roles that keep or read it.

- the broker keeps `Positions` over accepted groups (broker/state.py): a worker restarted in
  place asks for its own at `rejoin` and continues there;
- the trainer keeps `Positions` over trained groups and saves them in each checkpoint
  (`extra_state["rollout"]`, `CHECKPOINT_KEY`): a resumed run's worker reads its own with
  `resume_position`;
- the rule (`Positions.note`): per worker rank, the data position after its newest group so far
  (the largest group id); a straggler arriving after a newer group never moves it back.

On the wire (the `rejoin` reply), in the spill file and in meta.json a position is the map
`{"data_state": dict | None, "next_group_id": int}` and `Positions` a map of them by worker rank
(a string), as before this module; `from_dict` names an unknown or missing key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_slurm.sample_meta import SampleMeta
from relax_slurm.samples import Group, scalar_rows

CHECKPOINT_KEY = "rollout"
"""The key of a checkpoint's extra_state under which the trainer saves `Positions`."""
_KEYS = ("data_state", "next_group_id")


class PositionError(ValueError):
    """A data position that is not one: names the key."""


@dataclass(frozen=True)
class DataPosition:
    """Where a worker continues: its dataset's state_dict after the group's prompt (None: the
    agent proxy, which draws no prompts) and the id of its next group."""

    data_state: dict[str, Any] | None
    next_group_id: int

    def to_dict(self) -> dict[str, Any]:
        return {"data_state": self.data_state, "next_group_id": self.next_group_id}

    @classmethod
    def from_dict(cls, d: Any, where: str = "data position") -> DataPosition:
        if not isinstance(d, dict):
            raise PositionError(f"{where}: expected a map, got {d!r}")
        unknown = sorted(map(str, set(d) - set(_KEYS)))
        missing = [k for k in _KEYS if k not in d]
        if unknown or missing:
            raise PositionError(f"{where}: unknown key(s) {unknown}, missing key(s) {missing}; "
                                f"a data position has exactly {list(_KEYS)}")
        gid, state = d["next_group_id"], d["data_state"]
        if isinstance(gid, bool) or not isinstance(gid, int):
            raise PositionError(f"{where}: key 'next_group_id' must be int, got {gid!r}")
        if state is not None and not isinstance(state, dict):
            raise PositionError(f"{where}: key 'data_state' must be a map or None, got {state!r}")
        return cls(data_state=state, next_group_id=gid)


@dataclass
class Positions:
    """Per worker rank, its newest data position (see the module docstring)."""

    by_rank: dict[str, DataPosition] = field(default_factory=dict)

    def note(self, group: Group) -> None:
        """The group moves its worker's position if it is that worker's newest so far; a group
        no worker stamped (empty metadata) has no position."""
        first = scalar_rows(group)[0]
        meta = SampleMeta.of(first)
        if meta is None:
            return
        rank, next_id = str(meta.worker), first.group_id + 1
        known = self.by_rank.get(rank)
        if known is None or next_id > known.next_group_id:
            self.by_rank[rank] = DataPosition(meta.data_state, next_id)

    def get(self, rank: int) -> DataPosition | None:
        return self.by_rank.get(str(rank))

    def clear(self) -> None:
        self.by_rank.clear()

    def __len__(self) -> int:
        return len(self.by_rank)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {rank: p.to_dict() for rank, p in self.by_rank.items()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "data positions") -> Positions:
        if not isinstance(d, dict):
            raise PositionError(f"{where}: expected a map of worker rank -> position, got {d!r}")
        return cls({str(rank): DataPosition.from_dict(p, f"{where}[{rank!r}]")
                    for rank, p in d.items()})


def checkpoint_positions(extra_state: dict[str, Any]) -> Positions:
    """The positions a checkpoint's extra_state holds (none: a checkpoint without a worker)."""
    return Positions.from_dict(extra_state.get(CHECKPOINT_KEY, {}),
                               f"checkpoint extra_state[{CHECKPOINT_KEY!r}]")


def resume_position(resume_from: str | None, worker_rank: int) -> DataPosition | None:
    """Worker `worker_rank`'s position saved in the checkpoint `resume_from` (its meta.json:
    JSON, no torch), or None (no checkpoint, or none of that worker's groups trained)."""
    if not resume_from:
        return None
    extra = json.loads((Path(resume_from) / "meta.json").read_text())["extra_state"]
    return checkpoint_positions(extra).get(worker_rank)
