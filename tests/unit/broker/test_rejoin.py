"""A restarted worker rejoins: the credits its dead predecessor held come back, and it learns the
data position after that one's newest accepted group; both survive a broker restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_slurm.broker.spill import Spill, replay
from relax_slurm.broker.state import BrokerState
from relax_slurm.data_position import (CHECKPOINT_KEY, DataPosition, PositionError, Positions,
                                       checkpoint_positions, resume_position)
from relax_slurm.sample_meta import SampleMeta
from tests.helpers_broker import group


def with_position(gid: int, rank: int = 0):
    g = group(gid)
    for s in g:
        s.metadata = SampleMeta(data_state={"index": gid + 1}, worker=rank).to_dict()
    return g


def test_reclaim_and_positions(tmp_path: Path) -> None:
    state = BrokerState(max_staleness=0, batch_size=4)
    assert state.admit(3, "rollout0") == 3 and state.admit(1, "other") == 1
    state.accept(with_position(5), "rollout0")
    state.accept(with_position(2), "rollout0")  # out of order: the newest group id wins
    assert state.positions.to_dict() == {"0": {"data_state": {"index": 6}, "next_group_id": 6}}
    assert state.capacity() == 0
    assert state.reclaim("rollout0") == 1  # its third credit died with it
    assert state.reclaim("rollout0") == 0 and state.holders == {"other": 1}
    assert state.in_flight == 1 and state.capacity() == 1 and state.released == 1

    spill = Spill(tmp_path / "spill.bin")
    spill.start(state)
    spill.close()
    again = BrokerState(max_staleness=0, batch_size=4)
    got = replay(tmp_path / "spill.bin")
    again.load_snapshot(got.snapshot, list(got.queue.values()))
    assert again.holders == state.holders and again.positions == state.positions
    assert len(again.queue) == 2
    again.restore(again.counters())  # a global restart forgets both
    assert again.holders == {} and again.positions == Positions()


def test_the_trainer_keeps_positions_by_the_same_rule() -> None:
    """The trainer's checkpointed positions (trainer/main.py) are the broker's type with the
    same rule: per worker rank the newest group id wins, a straggler trained in a later step
    does not move it back, groups no worker stamped are skipped; a checkpoint's record reads
    back as it was written."""
    positions = Positions()
    for g in (with_position(4), with_position(7, rank=1), with_position(9)):
        positions.note(g)
    positions.note(with_position(6))  # a straggler of worker 0, trained later
    positions.note(group(20))  # no worker's metadata: not a position
    saved = {"0": {"data_state": {"index": 10}, "next_group_id": 10},
             "1": {"data_state": {"index": 8}, "next_group_id": 8}}
    assert positions.to_dict() == saved
    assert checkpoint_positions({CHECKPOINT_KEY: saved}) == positions
    assert checkpoint_positions({}) == Positions()


def test_the_worker_reads_its_position_from_a_checkpoint(tmp_path: Path) -> None:
    """meta.json as the trainer writes it (before this record was typed too): the worker's own
    rank's position, none for a rank the checkpoint does not know, none without a checkpoint."""
    extra = {"step": 3, CHECKPOINT_KEY: {"1": {"data_state": {"index": 5}, "next_group_id": 9}}}
    (tmp_path / "meta.json").write_text(json.dumps({"step": 3, "extra_state": extra}))
    assert resume_position(str(tmp_path), 1) == DataPosition({"index": 5}, 9)
    assert resume_position(str(tmp_path), 0) is None
    assert resume_position(None, 0) is None


def test_a_malformed_position_names_the_key() -> None:
    with pytest.raises(PositionError, match=r"unknown key\(s\) \['next_group'\], missing "
                                            r"key\(s\) \['next_group_id'\]"):
        DataPosition.from_dict({"data_state": None, "next_group": 3})
    with pytest.raises(PositionError, match=r"\['0'\]: key 'next_group_id' must be int"):
        Positions.from_dict({"0": {"data_state": None, "next_group_id": "3"}})
    assert Positions.from_dict({"2": DataPosition(None, 4).to_dict()}).get(2) == \
        DataPosition(None, 4)
