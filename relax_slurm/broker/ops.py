"""What each broker request does, and the answers of the requests it parked.

The loop (broker/server.py) decodes and authenticates a request, then calls the operation of
its name with (routing id, request id, fields, groups); the operation changes the state
(broker/state.py), answers through `reply` now or parks the request (broker/parked.py) to be
answered when a later request makes it possible (`wake`) or at its deadline (`expire`).
Requests that cannot be answered yet: `acquire` with no credit, `get_batch` with too few groups;
among waiters of one kind the first parked is the first answered.

No sockets here: `reply` and `publish` are the loop's, so every operation's answer goes through
the one place that spills it and remembers it for a resend.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from relax_slurm.broker.elastic_routes import ElasticRoutes
from relax_slurm.broker.parked import ParkedQueue
from relax_slurm.broker.roles import Roles, holder_of
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.stats import BrokerStats, BrokerStatus, Counters
from relax_slurm.errors import BrokerError
from relax_slurm.samples import Group

Op = Callable[[bytes, Any, dict[str, Any], "list[Group] | None"], None]


class Reply(Protocol):
    def __call__(self, identity: bytes, rid: Any, fields: dict[str, Any],
                 groups: list[Group] | None = None, op: str = "ok") -> None: ...


def field_of(fields: dict[str, Any], name: str, kind: type, minimum: float | None = 0) -> Any:
    """A request's field `name`, checked: of `kind` (an int passes for a float, a bool never)
    and at least `minimum`; BrokerError naming it otherwise."""
    value = fields.get(name)
    ok_types = (int, float) if kind is float else (kind,)
    if not isinstance(value, ok_types) or isinstance(value, bool):
        raise BrokerError(f"field {name!r} must be {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise BrokerError(f"field {name!r}={value} must be >= {minimum}")
    return value


class Operations:
    def __init__(self, state: BrokerState, elastic: ElasticRoutes, *, reply: Reply,
                 publish: Callable[[str, dict[str, Any]], None], stop: Callable[[], None],
                 auth_refused: Callable[[], int], log: Callable[[str], None]) -> None:
        self.state = state
        self.elastic = elastic
        self.roles = Roles()
        self.acquires = ParkedQueue()
        self.batches = ParkedQueue()
        self._reply, self._publish, self._stop = reply, publish, stop
        self._auth_refused = auth_refused
        self.log = log
        self.table: dict[str, Op] = {
            "acquire": self.acquire, "put_group": self.put_group, "release": self.release,
            "get_batch": self.get_batch, "set_version": self.set_version,
            "heartbeat": self.heartbeat, "stats": self.stats, "shutdown": self.shutdown,
            "rejoin": self.rejoin, "engines": self.engines,
        }

    # ---- parked requests -----------------------------------------------------------------
    def holds(self, identity: bytes, rid: Any) -> bool:
        """Whether this request is parked (a resend of it waits with it)."""
        return self.acquires.holds(identity, rid) or self.batches.holds(identity, rid)

    def deadlines(self) -> list[float]:
        return self.acquires.deadlines() + self.batches.deadlines()

    def wake(self) -> None:
        """Answer parked requests the state can now satisfy, batches first (drops free credit)."""
        now = time.monotonic()
        while (p := self.batches.first()) is not None:
            result = self.state.take_batch(p.args["num_groups"], p.args["version"],
                                           p.args["min_groups"])
            if result is None:
                break
            self.batches.pop_first()
            groups, stats = result
            stats.auth_refused = self._auth_refused()
            self._reply(p.identity, p.rid, {"stats": stats.to_dict(), "wait_s": now - p.start},
                        groups)
        while (p := self.acquires.first()) is not None:
            granted = self.state.admit(p.args["max_n"], holder_of(p.identity))
            if granted == 0:
                break
            self.acquires.pop_first()
            self._reply(p.identity, p.rid, {"granted": granted, "floor": self.floor()})

    def expire(self, now: float) -> None:
        for p in self.acquires.expired(now):
            self._reply(p.identity, p.rid, {"granted": 0, "floor": self.floor()})
        for p in self.batches.expired(now):
            self._reply(p.identity, p.rid, {"timeout": True, "wait_s": now - p.start})

    def refuse_parked(self, why: str) -> None:
        for p in self.acquires.take_all() + self.batches.take_all():
            self._reply(p.identity, p.rid, {"error": why, "shutdown": True}, op="error")

    # ---- credits and groups ----------------------------------------------------------------
    def acquire(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        max_n = field_of(fields, "max_n", int, 1)
        wait_s = field_of(fields, "wait_s", float)
        holder = self.roles.seen(identity)
        granted = (self.state.admit(max_n, holder)
                   if not self.acquires else 0)  # FIFO among waiters
        if granted or wait_s == 0:
            self._reply(identity, rid, {"granted": granted, "floor": self.floor()})
        else:
            self.acquires.park(identity, rid, {"max_n": max_n}, wait_s)

    def floor(self) -> int:
        """The oldest policy version a group may hold and still be trained on now: the
        workers stop sending requests to engines behind it (rollout/version_gate.py)."""
        return self.state.version - self.state.max_staleness

    def put_group(self, identity: bytes, rid: Any, _: dict[str, Any],
                  groups: list[Group] | None) -> None:
        """One finished group, or several (the groups a worker finished in one turn of its
        loop: broker/client.py), each for a credit: one message, one spill record."""
        if not groups:
            raise BrokerError("put_group carries no group; send one or more")
        if self.roles.retired(identity):
            raise BrokerError("put_group from a worker process that a restarted one replaced "
                              "(its credits were given back at the rejoin); dropped")
        self.state.accept_all(groups, holder_of(identity))
        self._reply(identity, rid, {"floor": self.floor()})
        self.wake()

    def release(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self.state.release(field_of(fields, "n", int), holder_of(identity))
        self._reply(identity, rid, {})
        self.wake()

    def get_batch(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        args = {"num_groups": field_of(fields, "num_groups", int, 1),
                "version": field_of(fields, "version", int),
                "min_groups": None}
        if fields.get("min_groups") is not None:  # streaming: whatever is queued past it
            args["min_groups"] = field_of(fields, "min_groups", int, 1)
            if args["min_groups"] > args["num_groups"]:
                raise BrokerError(f"get_batch min_groups={args['min_groups']} > num_groups="
                                  f"{args['num_groups']}")
        wait_s = field_of(fields, "wait_s", float)
        result = None
        if not self.batches:  # FIFO among waiting trainers
            result = self.state.take_batch(args["num_groups"], args["version"],
                                           args["min_groups"])
        if result is not None:
            groups, stats = result
            stats.auth_refused = self._auth_refused()
            self._reply(identity, rid, {"stats": stats.to_dict(), "wait_s": 0.0}, groups)
        elif wait_s == 0:
            self._reply(identity, rid, {"timeout": True, "wait_s": 0.0})
        else:
            self.batches.park(identity, rid, args, wait_s)
        self.wake()  # take_batch may have dropped stale groups, freeing credits

    def set_version(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        version = field_of(fields, "version", int)
        changed = version != self.state.version
        dropped = self.state.set_version(version)
        if changed:
            self._publish("version", {"version": version})
            c = self.state.counters()
            self.log(f"broker: version {version} accepted={c['accepted']} "
                     f"consumed={c['consumed']} dropped={c['dropped']} (+{dropped}) "
                     f"queue={c['queue_depth']} in_flight={c['in_flight']}")
        self._reply(identity, rid, {"version": version})
        self.wake()

    # ---- roles -----------------------------------------------------------------------------
    def rejoin(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        """A worker (re)starting: what an earlier process of its name held comes back, and it
        learns where that one was in the data (None if nowhere yet)."""
        rank = fields.get("rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise BrokerError(f"rejoin needs an integer rank, got {rank!r}")
        holder = self.roles.rejoin(identity)
        reclaimed = self.state.reclaim(holder)
        if reclaimed:
            self.log(f"broker: {holder} rejoined; {reclaimed} credits of its "
                     "predecessor came back")
        position = self.state.positions.get(rank)
        self._reply(identity, rid, {"reclaimed": reclaimed,
                                    "position": None if position is None else position.to_dict()})
        self.wake()

    def heartbeat(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self.roles.beat(fields.get("role"), fields.get("info"), time.monotonic())
        self._reply(identity, rid, {})

    def engines(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        """The engine list (broker/elastic_routes.py)."""
        self._reply(identity, rid, self.elastic.engines_op(fields))

    # ---- reports and the end ---------------------------------------------------------------
    def stats(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self._reply(identity, rid, BrokerStats(
            counters=Counters(**self.state.counters()),
            max_staleness=self.state.max_staleness,
            batch_size=self.state.batch_size,
            parked_acquires=len(self.acquires),
            parked_get_batch=len(self.batches),
            auth_refused=self._auth_refused(),
            heartbeat_age_s=self.roles.ages(time.monotonic()),
        ).to_dict())

    def status(self, now: float, started: float) -> BrokerStatus:
        """The run as the broker sees it at `now` (admin GET /status); up since `started`."""
        return BrokerStatus(
            counters=Counters(**self.state.counters()),
            max_staleness=self.state.max_staleness, batch_size=self.state.batch_size,
            admission_open=self.state.open,
            parked_acquires=len(self.acquires), parked_get_batch=len(self.batches),
            auth_refused=self._auth_refused(), uptime_s=now - started, pid=os.getpid(),
            engines=self.elastic.view(), roles=self.roles.view(now))

    def shutdown(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self._publish("shutdown", {})
        self.log("broker: shutdown requested")
        self._reply(identity, rid, {})
        self._stop()
