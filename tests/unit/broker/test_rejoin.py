"""A restarted worker rejoins: the credits its dead predecessor held come back, and it learns the
data position after that one's newest accepted group; both survive a broker restart."""

from __future__ import annotations

from pathlib import Path

from relax_slurm.broker.spill import Spill, replay
from relax_slurm.broker.state import BrokerState
from tests.helpers_broker import group


def with_position(gid: int, rank: int = 0):
    g = group(gid)
    for s in g:
        s.metadata.update(data_state={"index": gid + 1}, worker=rank)
    return g


def test_reclaim_and_positions(tmp_path: Path) -> None:
    state = BrokerState(max_staleness=0, batch_size=4)
    assert state.admit(3, "rollout0") == 3 and state.admit(1, "other") == 1
    state.accept(with_position(5), "rollout0")
    state.accept(with_position(2), "rollout0")  # out of order: the newest group id wins
    assert state.positions == {"0": {"data_state": {"index": 6}, "next_group_id": 6}}
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
    assert again.holders == {} and again.positions == {}


def test_the_trainer_keeps_positions_by_the_same_rule() -> None:
    """The trainer's checkpointed positions (trainer/main.py) follow samples.note_position as
    the broker does: per worker rank the newest group id wins, a straggler trained in a later
    step does not move it back, groups without a data position are skipped."""
    from relax_slurm.samples import note_position

    positions: dict = {}
    for g in (with_position(4), with_position(7, rank=1), with_position(9)):
        note_position(positions, g)
    note_position(positions, with_position(6))  # a straggler of worker 0, trained later
    note_position(positions, group(20))  # no data_state: not a position
    assert positions == {"0": {"data_state": {"index": 10}, "next_group_id": 10},
                         "1": {"data_state": {"index": 8}, "next_group_id": 8}}
