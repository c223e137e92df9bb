"""The broker process: a ROUTER socket for requests, a PUB socket for broadcasts.

One thread, one poll loop: receive, authenticate, answer a resent request from memory
(broker/resend.py), else run the operation of its name (broker/ops.py, which parks what cannot
be answered yet: broker/parked.py). The poll timeout is the time to the nearest parked
deadline, capped so a stop request (signal) is seen quickly. Every answer leaves through
`reply`, which spills it first and remembers it for a resend. The admin HTTP (broker/admin.py)
runs in a thread of its own and reads the state under the loop's lock.

Every request must carry the run's secret in its `auth` field (see relax_slurm/auth.py); one
without it or with a wrong one gets an `error` reply and is counted (`auth_refused`), and
nothing else happens. Inbound messages larger than `max_message_bytes` are dropped by ZMQ
(it disconnects that peer) before they reach the loop; anything else malformed gets an
`error` reply. No request can stop the loop except an authenticated `shutdown`.
"""

from __future__ import annotations

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
from relax_slurm.broker.ops import Operations
from relax_slurm.broker.resend import AnswerCache
from relax_slurm.broker.spill import Spill
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.broker.wire import decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.samples import Group

_MAX_POLL_S = 0.2
# long enough for the shutdown reply and broadcast to leave, short enough not to hang an exit
_CLOSE_LINGER_MS = 500
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


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
        self.ops = Operations(state, self.elastic, reply=self._reply, publish=self._publish,
                              stop=self.stop, auth_refused=lambda: self.auth_refused, log=log)
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
                    self.ops.expire(time.monotonic())
                    self.elastic.expire(time.monotonic())
        finally:
            self.ops.refuse_parked("broker is shutting down")
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
        wait = min([_MAX_POLL_S, *(d - time.monotonic() for d in self.ops.deadlines())])
        return max(0, int(wait * 1000) + 1)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        rid = None
        try:
            op, fields, groups = decode(frames[1:], keep_frames=True)
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
            operation = self.ops.table.get(op)
            if operation is None:
                raise BrokerError(f"unknown op {op!r}; expected one of {sorted(self.ops.table)}")
            operation(identity, rid, fields, groups)
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

    def _publish(self, topic: str, fields: dict[str, Any]) -> None:
        self.pub.send_multipart(publish_frames(topic, fields))

    def _is_resend(self, identity: bytes, rid: Any) -> bool:
        """A request seen before: answer it again from memory, or wait if it is parked."""
        if self.ops.holds(identity, rid):
            return True
        frames = self._answers.get(identity, rid)
        if frames is None:
            return False
        self.router.send_multipart([identity, *frames], copy=False)
        return True

    # ---- the admin thread's calls (broker/admin.py) ----------------------------------------
    def rollout_route(self, method: str, path: str, body: dict[str, Any]
                      ) -> tuple[int, dict[str, Any]]:
        """The admin HTTP's /rollout/... routes (broker/elastic_routes.py): (status, body)."""
        now = time.monotonic()
        with self._lock:
            return self.elastic.route(method, path, body, now)

    def _count_refused(self) -> None:
        with self._lock:
            self.auth_refused += 1

    def status(self) -> BrokerStatus:
        """The run as the broker sees it (admin GET /status): one consistent snapshot."""
        with self._lock:
            return self.ops.status(time.monotonic(), self._started)
