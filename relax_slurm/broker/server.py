"""The broker process: a ROUTER socket for requests, a PUB socket for broadcasts.

One thread, one poll loop. Requests that cannot be answered yet (`acquire` with no credit,
`get_batch` with too few groups) are parked with a deadline (broker/parked.py) and answered as
soon as a later request changes the state, or at the deadline. The poll timeout is the time to
the nearest deadline, capped so a stop request (signal) is seen quickly. A resent request gets
its earlier reply again (broker/resend.py); the engine list's operation and admin routes are
broker/elastic_routes.py's.

Every request must carry the run's secret in its `auth` field (see relax_slurm/auth.py); one
without it or with a wrong one gets an `error` reply and is counted (`auth_refused`), and
nothing else happens. Inbound messages larger than `max_message_bytes` are dropped by ZMQ
(it disconnects that peer) before they reach the loop; anything else malformed gets an
`error` reply. No request can stop the loop except an authenticated `shutdown`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from relax_slurm.auth import secret_matches
from relax_slurm.broker.admin import AdminServer
from relax_slurm.broker.elastic import Elastic
from relax_slurm.broker.elastic_routes import ElasticRoutes
from relax_slurm.broker.parked import ParkedQueue
from relax_slurm.broker.resend import AnswerCache
from relax_slurm.broker.spill import Spill
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.stats import BrokerStats, BrokerStatus, Counters
from relax_slurm.broker.wire import decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.samples import Group

_MAX_POLL_S = 0.2
# long enough for the shutdown reply and broadcast to leave, short enough not to hang an exit
_CLOSE_LINGER_MS = 500
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_MAX_ROLES = 4096  # distinct heartbeat names kept (a bound on what a buggy client can add)


def _get(fields: dict[str, Any], name: str, kind: type, minimum: float | None = 0) -> Any:
    value = fields.get(name)
    ok_types = (int, float) if kind is float else (kind,)
    if not isinstance(value, ok_types) or isinstance(value, bool):
        raise BrokerError(f"field {name!r} must be {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise BrokerError(f"field {name!r}={value} must be >= {minimum}")
    return value


def _holder(identity: bytes) -> str:
    """The name part of a client's routing id ("rollout0" of "rollout0:9f3a..."): the same for
    every process of one role, unlike the routing id."""
    return identity.split(b":", 1)[0].decode("utf-8", "replace")


def publish_frames(topic: str, fields: dict[str, Any]) -> list[bytes]:
    return [topic.encode(), msgpack.packb(fields, use_bin_type=True)]


class BrokerServer:
    def __init__(self, state: BrokerState, router_addr: str, pub_addr: str, *, secret: str,
                 admin: tuple[str, int] | None = None, spill: Spill | None = None,
                 answers: list[tuple[bytes, Any, dict[str, Any], list[Group] | None]] = (),
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 elastic: Elastic | None = None, elastic_file: Path | None = None,
                 log: Callable[[str], None] = lambda line: None) -> None:
        if not secret:
            raise BrokerError("the broker needs the run's secret (RELAX_RUN_SECRET); relax-train "
                              "sets it for every role")
        self.state = state
        self.log = log
        # the engine list and scale operations (broker/elastic.py); admin HTTP /rollout/...
        self.elastic = ElasticRoutes(elastic if elastic is not None else Elastic([]),
                                     elastic_file, log)
        self._secret = secret
        self.auth_refused = 0
        self._bind(router_addr, pub_addr, max_message_bytes)
        self._acquires = ParkedQueue()
        self._batches = ParkedQueue()
        self._heartbeats: dict[str, tuple[float, dict[str, Any]]] = {}
        # routing ids seen per holder name, and those of processes a rejoin replaced: a group a
        # dead worker had sent before its successor rejoined must not use the successor's credit
        self._ids_of: dict[str, set[bytes]] = {}
        self._retired: set[bytes] = set()
        self._started = time.monotonic()
        self.spill = spill
        # the latest replies: a client that resends a request (its reply was lost, or the
        # broker restarted) gets the same answer again
        self._answers = AnswerCache()
        for identity, rid, fields, groups in answers:  # replayed from the spill
            self._answers.remember(identity, rid, encode("ok", {**fields, "rid": rid}, groups))
        # held by the loop while it handles a request, and by the admin thread's status()
        self._lock = threading.Lock()
        self.admin: AdminServer | None = None
        if admin is not None:
            try:
                self.admin = AdminServer(*admin, secret=secret, status=self.status,
                                         on_refused=self._count_refused, route=self.rollout_route)
            except BrokerError:
                self.close()
                raise
        self._stopping = False
        self._handlers: dict[str, Callable[[bytes, Any, dict[str, Any], list[Group] | None],
                                           None]] = {
            "acquire": self._acquire, "put_group": self._put_group, "release": self._release,
            "get_batch": self._get_batch, "set_version": self._set_version,
            "heartbeat": self._heartbeat, "stats": self._stats, "shutdown": self._shutdown,
            "rejoin": self._rejoin, "engines": self._engines,
        }

    def _bind(self, router_addr: str, pub_addr: str, max_message_bytes: int) -> None:
        self._ctx = zmq.Context()
        self.router = self._ctx.socket(zmq.ROUTER)
        # a peer sending more than this in one message is disconnected by ZMQ: a bogus length
        # can never make the broker allocate without bound
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.pub = self._ctx.socket(zmq.PUB)
        try:
            self.router.bind(router_addr)
            self.pub.bind(pub_addr)
        except zmq.ZMQError as e:
            self.close()
            raise BrokerError(f"cannot bind broker sockets {router_addr} / {pub_addr}: {e}; "
                              "pick free ports or another host address") from e
        self.router_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- loop ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to exit (safe from a signal handler)."""
        self._stopping = True

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        if self.admin is not None:
            self.admin.start()
        try:
            while not self._stopping:
                if poller.poll(self._poll_timeout_ms()):
                    # drain everything queued before expiring deadlines: a put that arrived in
                    # time should still satisfy a get_batch whose deadline is now
                    while not self._stopping and self.router.poll(0):
                        frames = self.router.recv_multipart(copy=False)
                        with self._lock:
                            self._handle(frames)
                with self._lock:
                    self._expire(time.monotonic())
                    self.elastic.expire(time.monotonic())
        finally:
            self._refuse_parked("broker is shutting down")
            self.close()

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        for sock in (self.router, self.pub):
            if not sock.closed:
                sock.close(linger=_CLOSE_LINGER_MS)
        self._ctx.term()

    def _poll_timeout_ms(self) -> int:
        deadlines = self._acquires.deadlines() + self._batches.deadlines()
        wait = min([_MAX_POLL_S, *(d - time.monotonic() for d in deadlines)])
        return max(0, int(wait * 1000) + 1)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        rid = None
        try:
            op, fields, groups = decode(frames[1:])
            rid = fields.get("rid")
            if not secret_matches(self._secret, fields.pop("auth", None)):
                self.auth_refused += 1
                raise BrokerError("unauthenticated request: missing or wrong run secret (clients "
                                  "of a run read it from RELAX_RUN_SECRET, set by relax-train; "
                                  "tools read RUN_DIR/secret)")
            if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
                raise BrokerError(f"request id rid={rid!r}: must be an integer")
            if rid is not None and self._is_resend(identity, rid):
                return
            handler = self._handlers.get(op)
            if handler is None:
                raise BrokerError(f"unknown op {op!r}; expected one of {sorted(self._handlers)}")
            handler(identity, rid, fields, groups)
        except BrokerError as e:
            self._reply(identity, rid, {"error": str(e)}, op="error")
        except Exception as e:  # a bug must not kill the broker (that restarts the whole run)
            traceback.print_exc(file=sys.stderr)
            self._reply(identity, rid, {"error": f"internal broker error: {e!r}"}, op="error")

    def _reply(self, identity: bytes, rid: Any, fields: dict[str, Any],
               groups: list[Group] | None = None, op: str = "ok") -> None:
        if self.spill is not None and op == "ok":
            # on file before the client hears of it (a no-op unless the state changed)
            self.spill.record(self.state, (identity, rid), fields, groups)
        frames = encode(op, {**fields, "rid": rid}, groups)
        if rid is not None and op == "ok":
            self._answers.remember(identity, rid, frames)
        self.router.send_multipart([identity, *frames], copy=False)

    def _is_resend(self, identity: bytes, rid: Any) -> bool:
        """A request seen before: answer it again from memory, or wait if it is parked."""
        if self._acquires.holds(identity, rid) or self._batches.holds(identity, rid):
            return True
        frames = self._answers.get(identity, rid)
        if frames is None:
            return False
        self.router.send_multipart([identity, *frames], copy=False)
        return True

    # ---- parked requests -----------------------------------------------------------------
    def _wake(self) -> None:
        """Answer parked requests the state can now satisfy, batches first (drops free credit)."""
        now = time.monotonic()
        while (p := self._batches.first()) is not None:
            result = self.state.take_batch(p.args["num_groups"], p.args["version"],
                                           p.args["min_groups"])
            if result is None:
                break
            self._batches.pop_first()
            groups, stats = result
            stats.auth_refused = self.auth_refused
            self._reply(p.identity, p.rid, {"stats": stats.to_dict(), "wait_s": now - p.start},
                        groups)
        while (p := self._acquires.first()) is not None:
            granted = self.state.admit(p.args["max_n"], _holder(p.identity))
            if granted == 0:
                break
            self._acquires.pop_first()
            self._reply(p.identity, p.rid, {"granted": granted})

    def _expire(self, now: float) -> None:
        for p in self._acquires.expired(now):
            self._reply(p.identity, p.rid, {"granted": 0})
        for p in self._batches.expired(now):
            self._reply(p.identity, p.rid, {"timeout": True, "wait_s": now - p.start})

    def _refuse_parked(self, why: str) -> None:
        for p in self._acquires.take_all() + self._batches.take_all():
            self._reply(p.identity, p.rid, {"error": why, "shutdown": True}, op="error")

    # ---- ops -----------------------------------------------------------------------------
    def _acquire(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        max_n = _get(fields, "max_n", int, 1)
        wait_s = _get(fields, "wait_s", float)
        self._ids_of.setdefault(_holder(identity), set()).add(identity)
        granted = (self.state.admit(max_n, _holder(identity))
                   if not self._acquires else 0)  # FIFO among waiters
        if granted or wait_s == 0:
            self._reply(identity, rid, {"granted": granted})
        else:
            self._acquires.park(identity, rid, {"max_n": max_n}, wait_s)

    def _put_group(self, identity: bytes, rid: Any, _: dict[str, Any],
                   groups: list[Group] | None) -> None:
        if groups is None or len(groups) != 1:
            raise BrokerError("put_group carries exactly one group")
        if identity in self._retired:
            raise BrokerError("put_group from a worker process that a restarted one replaced "
                              "(its credits were given back at the rejoin); dropped")
        self.state.accept(groups[0], _holder(identity))
        self._reply(identity, rid, {})
        self._wake()

    def _release(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self.state.release(_get(fields, "n", int), _holder(identity))
        self._reply(identity, rid, {})
        self._wake()

    def _get_batch(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        args = {"num_groups": _get(fields, "num_groups", int, 1),
                "version": _get(fields, "version", int),
                "min_groups": None}
        if fields.get("min_groups") is not None:  # streaming: whatever is queued past it
            args["min_groups"] = _get(fields, "min_groups", int, 1)
            if args["min_groups"] > args["num_groups"]:
                raise BrokerError(f"get_batch min_groups={args['min_groups']} > num_groups="
                                  f"{args['num_groups']}")
        wait_s = _get(fields, "wait_s", float)
        result = None
        if not self._batches:  # FIFO among waiting trainers
            result = self.state.take_batch(args["num_groups"], args["version"],
                                           args["min_groups"])
        if result is not None:
            groups, stats = result
            stats.auth_refused = self.auth_refused
            self._reply(identity, rid, {"stats": stats.to_dict(), "wait_s": 0.0}, groups)
        elif wait_s == 0:
            self._reply(identity, rid, {"timeout": True, "wait_s": 0.0})
        else:
            self._batches.park(identity, rid, args, wait_s)
        self._wake()  # take_batch may have dropped stale groups, freeing credits

    def _set_version(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        version = _get(fields, "version", int)
        changed = version != self.state.version
        dropped = self.state.set_version(version)
        if changed:
            self.pub.send_multipart(publish_frames("version", {"version": version}))
            c = self.state.counters()
            self.log(f"broker: version {version} accepted={c['accepted']} "
                     f"consumed={c['consumed']} dropped={c['dropped']} (+{dropped}) "
                     f"queue={c['queue_depth']} in_flight={c['in_flight']}")
        self._reply(identity, rid, {"version": version})
        self._wake()

    def _rejoin(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        """A worker (re)starting: what an earlier process of its name held comes back, and it
        learns where that one was in the data (None if nowhere yet)."""
        rank = fields.get("rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise BrokerError(f"rejoin needs an integer rank, got {rank!r}")
        holder = _holder(identity)
        self._retired |= self._ids_of.pop(holder, set()) - {identity}
        self._ids_of[holder] = {identity}
        reclaimed = self.state.reclaim(holder)
        if reclaimed:
            self.log(f"broker: {_holder(identity)} rejoined; {reclaimed} credits of its "
                     "predecessor came back")
        position = self.state.positions.get(rank)
        self._reply(identity, rid, {"reclaimed": reclaimed,
                                    "position": None if position is None else position.to_dict()})
        self._wake()

    def _heartbeat(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        role = fields.get("role")
        if not isinstance(role, str) or not role or len(role) > 128:
            raise BrokerError(f"heartbeat needs a non-empty role string, got {role!r}")
        info = fields.get("info") or {}
        if not isinstance(info, dict) or len(info) > 32:
            raise BrokerError("heartbeat info must be a map of at most 32 entries")
        if role not in self._heartbeats and len(self._heartbeats) >= _MAX_ROLES:
            raise BrokerError(f"more than {_MAX_ROLES} roles heartbeat; refusing {role!r}")
        self._heartbeats[role] = (time.monotonic(), info)
        self._reply(identity, rid, {})

    # ---- elastic rollout (broker/elastic_routes.py) ----------------------------------------
    def _engines(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self._reply(identity, rid, self.elastic.engines_op(fields))

    def rollout_route(self, method: str, path: str, body: dict[str, Any]
                      ) -> tuple[int, dict[str, Any]]:
        """The admin HTTP's /rollout/... routes (see broker/admin.py): (status code, body)."""
        now = time.monotonic()
        with self._lock:
            return self.elastic.route(method, path, body, now)

    def _count_refused(self) -> None:
        with self._lock:
            self.auth_refused += 1

    def status(self) -> BrokerStatus:
        """The run as the broker sees it (admin GET /status): one consistent snapshot."""
        with self._lock:
            now = time.monotonic()
            c = Counters(**self.state.counters())
            return BrokerStatus(
                version=c.version, queue_depth=c.queue_depth, in_flight=c.in_flight, counters=c,
                max_staleness=self.state.max_staleness, batch_size=self.state.batch_size,
                admission_open=self.state.open,
                parked_acquires=len(self._acquires), parked_get_batch=len(self._batches),
                auth_refused=self.auth_refused, uptime_s=now - self._started,
                pid=os.getpid(),
                engines=self.elastic.view(),
                roles={role: {"heartbeat_age_s": now - t, **info}
                       for role, (t, info) in sorted(self._heartbeats.items())},
            )

    def _stats(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        now = time.monotonic()
        self._reply(identity, rid, BrokerStats(
            **self.state.counters(),
            max_staleness=self.state.max_staleness,
            batch_size=self.state.batch_size,
            parked_acquires=len(self._acquires),
            parked_get_batch=len(self._batches),
            auth_refused=self.auth_refused,
            heartbeat_age_s={role: now - t for role, (t, _) in self._heartbeats.items()},
        ).to_dict())

    def _shutdown(self, identity: bytes, rid: Any, fields: dict[str, Any], _: Any) -> None:
        self.pub.send_multipart(publish_frames("shutdown", {}))
        self.log("broker: shutdown requested")
        self._reply(identity, rid, {})
        self.stop()
