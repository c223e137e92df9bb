"""The broker's state machine: credits (admission control), the group queue, the drop rule.

Pure: no sockets, no clocks, no I/O, so every rule is unit- and property-testable.

Admission: a worker may start a new prompt group only while

    (accepted - dropped) + in_flight < (max_staleness + version + 1) * batch_size

Groups that were dropped as stale give their credit back (otherwise a drop would shrink the
budget for good and, with enough drops, deadlock the run); released groups (abandoned or
filtered by the worker) give it back too because they leave `in_flight` without entering
`accepted`. With the trainer consuming `batch_size` groups per version this keeps at most
`(max_staleness + 1) * batch_size` groups queued or in flight.

Drop rule: a group whose oldest sample version lags the trainer by more than `max_staleness`
is never handed out. Admission alone bounds staleness when groups come back in the order they
were admitted; a straggler overtaken by later groups can still come back too old, and this
rule catches it.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from relax_slurm.errors import BrokerError
from relax_slurm.broker.stats import BatchStats, Counters
from relax_slurm.data_position import Positions
from relax_slurm.sample_meta import MetadataError, metas_of
from relax_slurm.samples import Group, group_version_min, scalar_rows

COUNTER_NAMES = ("version", "accepted", "dropped", "consumed", "in_flight", "released")


class BrokerState:
    def __init__(self, max_staleness: int, batch_size: int, open_admission: bool = True) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise BrokerError(f"max_staleness={max_staleness} must be >= 0 and "
                              f"batch_size={batch_size} >= 1")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.version = 0
        self.accepted = 0
        self.dropped = 0
        self.consumed = 0
        self.in_flight = 0
        self.released = 0
        self.queue: deque[Group] = deque()
        # credits in flight per holder (a worker's name), so that a restarted worker can give
        # back what its dead predecessor held (`reclaim`); and per worker rank the data position
        # after its newest accepted group, where a restarted worker continues
        self.holders: dict[str, int] = {}
        self.positions = Positions()
        # A run's broker starts closed: nothing is generated until the trainer has pushed its
        # weights to the engines and announced that version (fresh start or resume alike).
        self.open = open_admission

    # ---- workers -------------------------------------------------------------------------
    def capacity(self) -> int:
        """Credits that could be granted right now."""
        if not self.open:
            return 0
        budget = (self.max_staleness + self.version + 1) * self.batch_size
        return max(0, budget - (self.accepted - self.dropped) - self.in_flight)

    def admit(self, max_n: int, holder: str | None = None) -> int:
        """Grant up to `max_n` credits (one per prompt group to start)."""
        n = min(max(0, max_n), self.capacity())
        self.in_flight += n
        if holder is not None and n:
            self.holders[holder] = self.holders.get(holder, 0) + n
        return n

    def _give_back(self, holder: str | None, n: int) -> None:
        if holder is not None and self.holders.get(holder, 0) > 0:
            self.holders[holder] = max(0, self.holders[holder] - n)

    def accept(self, group: Group, holder: str | None = None) -> None:
        """A worker returns a finished group for a credit it holds."""
        self.accept_all([group], holder)

    def accept_all(self, groups: list[Group], holder: str | None = None) -> None:
        """Finished groups for credits the worker holds (several: those its loop finished in
        one turn, sent as one put_group): all accepted, or, if one breaks the contract, none."""
        if self.in_flight < len(groups):
            raise BrokerError(f"put_group without a credit for each group ({len(groups)} "
                              f"group(s), {self.in_flight} credit(s) in flight): call acquire "
                              "before generating")
        for group in groups:  # first: a group whose metadata breaks the contract changes nothing
            if not group:
                raise BrokerError("put_group with an empty group; send at least one sample")
            try:
                metas_of(scalar_rows(group))  # (mostly one map a group: checked once)
            except MetadataError as e:
                raise BrokerError(f"put_group: {e}") from e
        for group in groups:
            self.positions.note(group)
            self.in_flight -= 1
            self._give_back(holder, 1)
            self.accepted += 1
            if self._is_stale(group, self.version):
                # too old for any trainer at >= self.version: drop now so its credit frees at once
                self.dropped += 1
            else:
                self.queue.append(group)

    def release(self, n: int, holder: str | None = None) -> None:
        """A worker gives back `n` credits it will not turn into groups."""
        if n < 0 or n > self.in_flight:
            raise BrokerError(f"release({n}) but only {self.in_flight} credits are in flight")
        self.in_flight -= n
        self.released += n
        self._give_back(holder, n)

    def reclaim(self, holder: str) -> int:
        """A restarted worker: the credits its dead predecessor held come back (their groups
        will never arrive); returns how many."""
        n = min(self.holders.pop(holder, 0), self.in_flight)
        self.in_flight -= n
        self.released += n
        return n

    # ---- trainer -------------------------------------------------------------------------
    def _is_stale(self, group: Group, trainer_version: int) -> bool:
        return trainer_version - group_version_min(group) > self.max_staleness

    def _drop_stale(self, trainer_version: int) -> int:
        fresh = [g for g in self.queue if not self._is_stale(g, trainer_version)]
        n = len(self.queue) - len(fresh)
        if n:
            self.queue = deque(fresh)
        self.dropped += n
        return n

    def take_batch(self, num_groups: int, trainer_version: int, min_groups: int | None = None
                   ) -> tuple[list[Group], BatchStats] | None:
        """The oldest fresh groups with staleness stats, or None (keep waiting): `num_groups`
        of them, or as many as are queued once there are `min_groups` (a streaming trainer
        takes a step's groups as they arrive; see trainer/stream.py)."""
        least = num_groups if min_groups is None else min_groups
        if not 1 <= least <= num_groups:
            raise BrokerError(f"get_batch num_groups={num_groups}, min_groups={min_groups}: "
                              "need 1 <= min_groups <= num_groups")
        self._drop_stale(trainer_version)
        if len(self.queue) < least:
            return None
        taken = min(num_groups, len(self.queue))
        groups = [self.queue.popleft() for _ in range(taken)]
        self.consumed += taken
        staleness = [trainer_version - s.version_min for g in groups for s in scalar_rows(g)]
        stats = BatchStats(
            staleness_max=max(staleness),
            staleness_mean=sum(staleness) / len(staleness),
            staleness_hist=dict(sorted(Counter(staleness).items())),
            counters=Counters(**self.counters()),
        )
        return groups, stats

    def set_version(self, version: int) -> int:
        """Move the policy version forward; returns how many queued groups became stale."""
        if version < self.version:
            raise BrokerError(f"set_version({version}) but the broker is at {self.version}; "
                              "versions only move forward (resume from a matching checkpoint)")
        self.version = version
        self.open = True
        return self._drop_stale(version)

    # ---- resume --------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in COUNTER_NAMES}, "queue_depth": len(self.queue)}

    def restore(self, counters: dict[str, int]) -> None:
        """Resume from saved counters with an empty queue and no credits in flight."""
        missing = [k for k in ("version", "dropped", "consumed") if k not in counters]
        if missing:
            raise BrokerError(f"restore: counters lack {missing}")
        self.version = int(counters["version"])
        self.dropped = int(counters["dropped"])
        self.consumed = int(counters["consumed"])
        self.released = int(counters.get("released", 0))
        # groups queued at save time are not restored; counting them as accepted would keep
        # their credits taken forever (and deadlock a run that saved a full queue)
        self.accepted = self.consumed + self.dropped
        self.in_flight = 0
        self.holders.clear()
        self.positions.clear()
        self.queue.clear()

    def snapshot(self) -> dict[str, Any]:
        """Every counter and the admission flag: with the queued groups, the whole state (what
        the spill file records; see spill.py)."""
        return {**{k: getattr(self, k) for k in COUNTER_NAMES}, "open": self.open,
                "holders": dict(self.holders), "positions": self.positions.to_dict()}

    def load_snapshot(self, snap: dict[str, Any], queue: list[Group]) -> None:
        """Continue exactly where a broker that recorded `snap` and `queue` stopped (a restart in
        place): unlike `restore`, credits in flight stay taken, because their workers are still
        generating and will put their groups."""
        missing = [k for k in (*COUNTER_NAMES, "open") if k not in snap]
        if missing:
            raise BrokerError(f"load_snapshot: snapshot lacks {missing}")
        for k in COUNTER_NAMES:
            setattr(self, k, int(snap[k]))
        self.open = bool(snap["open"])
        self.holders = {str(k): int(v) for k, v in snap.get("holders", {}).items()}
        self.positions = Positions.from_dict(snap.get("positions", {}), "snapshot positions")
        self.queue = deque(queue)
