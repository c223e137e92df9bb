"""Clients of the broker: synchronous (trainer, tools), asyncio (rollout workers), subscriber.

Every request carries a request id `rid` that the broker echoes. The sync client uses it to
discard a late reply to an earlier request that timed out; the async client uses it to route
replies to the awaiting task, so many tasks can share one socket.
Every receive is bounded: a parked op (`acquire`, `get_batch`) gets `wait_s + timeout_s`.
Within that budget a request without a reply is sent again (same rid) after `wait_s +
RESEND_S`, then at doubling intervals: a broker restarted in place (a kill -9, see spill.py)
lost the requests it had received, and ZMQ reconnects by itself. Resends are safe: the broker
answers a request id it has answered before with the same reply (from memory, or replayed from
its spill file) and ignores one that is still parked.
Every request carries the run's secret (`auth` field): by default the one relax-train gave this
process (`relax_slurm.auth.run_secret`); tools outside the run pass `read_secret(RUN_DIR)`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from relax_slurm.auth import run_secret
from relax_slurm.broker.stats import BatchStats, BrokerStats
from relax_slurm.broker.wire import decode, encode, group_nbytes
from relax_slurm.errors import BrokerError, BrokerShutdown, BrokerTimeout
from relax_slurm.samples import Group

Batch = tuple[list[Group], BatchStats]
RESEND_S = 2.0
_RESEND_MAX_S = 8.0


def _dealer(ctx: zmq.Context, addr: str, identity: str | None, timeout_s: float
            ) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a fixed routing id, kept across reconnects: the broker recognises a resent request by
    # (routing id, rid)
    # with the broker gone, requests queue up to the high-water mark and then a send would
    # block forever; a send timeout turns that into BrokerTimeout too
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    # readable in a debugger or packet dump; the suffix keeps two clients that were given the
    # same name from receiving each other's replies
    sock.setsockopt(zmq.ROUTING_ID, f"{identity or 'client'}:{uuid.uuid4().hex[:12]}".encode())
    sock.connect(addr)
    return sock


def _result(addr: str, op: str, reply: tuple[str, dict[str, Any], list[Group] | None]
            ) -> tuple[dict[str, Any], list[Group] | None]:
    kind, fields, groups = reply
    if kind == "error":
        cls = BrokerShutdown if fields.get("shutdown") else BrokerError
        raise cls(f"broker at {addr} refused {op}: {fields.get('error')}")
    return fields, groups


def _timeout(op: str, addr: str, after_s: float) -> BrokerTimeout:
    return BrokerTimeout(f"no reply to {op!r} from the broker at {addr} within {after_s:.1f}s; "
                         "check that the broker is running (its log) or raise "
                         "broker.request_timeout_s")


def _batch(fields: dict[str, Any], groups: list[Group] | None) -> Batch | None:
    if fields.get("timeout"):
        return None
    stats = BatchStats.from_dict(fields["stats"])
    stats.wait_s = fields["wait_s"]
    return groups or [], stats


class BrokerClient:
    """Blocking client; one request at a time."""

    def __init__(self, addr: str, timeout_s: float, identity: str | None = None,
                 secret: str | None = None) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self._auth = secret or run_secret()
        self._sock = _dealer(zmq.Context.instance(), addr, identity, timeout_s)
        self._rids = itertools.count()

    def _frames(self, op: str, fields: dict[str, Any], rid: int, groups: list[Group] | None
                ) -> list[Any]:
        return encode(op, {**fields, "rid": rid, "auth": self._auth}, groups)

    def _call(self, op: str, fields: dict[str, Any], groups: list[Group] | None = None,
              wait_s: float = 0.0) -> tuple[dict[str, Any], list[Group] | None]:
        rid = next(self._rids)
        budget = wait_s + self.timeout_s
        frames = self._frames(op, fields, rid, groups)
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again as e:
            raise _timeout(op, self.addr, self.timeout_s) from e
        now = time.monotonic()
        end, resend_at, every = now + budget, now + wait_s + RESEND_S, RESEND_S
        while True:
            now = time.monotonic()
            if now >= end:
                raise _timeout(op, self.addr, budget)
            if now >= resend_at:
                try:
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # queue full while the broker is away: the next resend retries
                every = min(2 * every, _RESEND_MAX_S)
                resend_at = now + every
            wait_ms = int((min(end, resend_at) - now) * 1000) + 1
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                continue
            reply = decode(self._sock.recv_multipart(copy=False))
            got = reply[1].get("rid")
            if got == rid or (got is None and reply[0] == "error"):
                return _result(self.addr, op, reply)
            # else: a late reply to an earlier request that timed out; skip it

    def acquire(self, max_n: int, wait_s: float = 0.0) -> int:
        return int(self._call("acquire", {"max_n": max_n, "wait_s": wait_s}, wait_s=wait_s)[0]
                   ["granted"])

    def put_group(self, group: Group) -> None:
        self._call("put_group", {}, [group])

    def release(self, n: int) -> None:
        self._call("release", {"n": n})

    def get_batch(self, num_groups: int, version: int, wait_s: float = 0.0,
                  min_groups: int | None = None) -> Batch | None:
        """`num_groups` groups; with `min_groups`, whatever is queued once that many are."""
        fields, groups = self._call(
            "get_batch", {"num_groups": num_groups, "version": version, "wait_s": wait_s,
                          **({} if min_groups is None else {"min_groups": min_groups})},
            wait_s=wait_s)
        return _batch(fields, groups)

    def set_version(self, version: int) -> None:
        self._call("set_version", {"version": version})

    def rejoin(self, rank: int) -> dict[str, Any]:
        fields, _ = self._call("rejoin", {"rank": rank})
        fields.pop("rid", None)
        return fields

    def heartbeat(self, role: str, **info: Any) -> None:
        """`role` is alive and making progress; `info` (msgpack-able) shows in /status."""
        self._call("heartbeat", {"role": role, "info": info})

    def engines(self, synced: list[str] | None = None, drained: list[str] = ()
                ) -> dict[str, Any]:
        """The engine list (broker/elastic.py); `synced`: the trainer's cohort holds exactly
        these engines with the current weights; `drained`: see AsyncBrokerClient.engines."""
        fields, _ = self._call("engines", {"drained": list(drained),
                                           **({} if synced is None else {"synced": synced})})
        fields.pop("rid", None)
        return fields

    def stats(self) -> BrokerStats:
        fields, _ = self._call("stats", {})
        fields.pop("rid", None)
        return BrokerStats.from_dict(fields)

    def shutdown(self) -> None:
        self._call("shutdown", {})

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBrokerClient:
    """asyncio client; its coroutines may be awaited concurrently from many tasks.

    One receive task reads every reply and resolves the future of the request with that rid.
    Create and use it inside one running event loop.
    """

    def __init__(self, addr: str, timeout_s: float, identity: str | None = None,
                 secret: str | None = None, max_put_bytes: int = 256 << 20) -> None:
        """`max_put_bytes`: the groups of one loop turn go in messages of at most about this
        many bytes (a larger group alone): the broker drops, unread, any message over
        broker.max_message_mb, and 32 groups of video frames could pass it where one did not."""
        self.addr = addr
        self.timeout_s = timeout_s
        self.max_put_bytes = max_put_bytes
        self._auth = secret or run_secret()
        self._sock = _dealer(zmq.asyncio.Context.instance(), addr, identity, timeout_s)
        self._rids = itertools.count()
        self._pending: dict[int, asyncio.Future[tuple[str, dict[str, Any], Any]]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self.floor: int | None = None
        """The oldest policy version the broker accepts, from its latest grant or accept."""
        self._puts: list[tuple[Group, asyncio.Future[None]]] = []
        self._put_sends: set[asyncio.Task[None]] = set()

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                reply = decode(frames)
            except BrokerError as e:
                # nothing to route it to; fail everyone waiting rather than let them time out
                for fut in self._pending.values():
                    if not fut.done():
                        fut.set_exception(BrokerError(f"bad reply from {self.addr}: {e}"))
                continue
            fut = self._pending.get(reply[1].get("rid"))  # late replies find no future
            if fut is not None and not fut.done():
                fut.set_result(reply)

    _frames = BrokerClient._frames

    async def _send(self, frames: list[Any]) -> None:
        async with self._send_lock:
            await self._sock.send_multipart(frames, copy=False)

    async def _call(self, op: str, fields: dict[str, Any], groups: list[Group] | None = None,
                    wait_s: float = 0.0) -> tuple[dict[str, Any], list[Group] | None]:
        if self._receiver is None or self._receiver.done():
            if self._receiver is not None and not self._receiver.cancelled():
                self._receiver.result()  # re-raise why the receive task died
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())
        rid = next(self._rids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        budget = wait_s + self.timeout_s
        frames = self._frames(op, fields, rid, groups)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._send(frames), self.timeout_s)
            end = loop.time() + budget
            resend_at, every = loop.time() + wait_s + RESEND_S, RESEND_S
            while not fut.done():
                now = loop.time()
                if now >= end:
                    raise asyncio.TimeoutError
                if now >= resend_at:  # see the module's docstring
                    await asyncio.wait_for(self._send(frames), max(end - now, 0.001))
                    every = min(2 * every, _RESEND_MAX_S)
                    resend_at = loop.time() + every
                await asyncio.wait({fut}, timeout=max(min(end, resend_at) - loop.time(), 0))
            reply = fut.result()
        except (asyncio.TimeoutError, zmq.Again) as e:
            raise _timeout(op, self.addr, budget) from e
        finally:
            self._pending.pop(rid, None)
        return _result(self.addr, op, reply)

    async def engines(self, drained: list[str] = ()) -> dict[str, Any]:
        """The engine list (broker/elastic.py); `drained`: this worker routes nothing to these
        engines any more and has no request in flight there."""
        fields, _ = await self._call("engines", {"drained": list(drained)})
        fields.pop("rid", None)
        return fields

    def _note_floor(self, fields: dict[str, Any]) -> None:
        if fields.get("floor") is not None:
            self.floor = int(fields["floor"])

    async def acquire(self, max_n: int, wait_s: float = 0.0) -> int:
        fields, _ = await self._call("acquire", {"max_n": max_n, "wait_s": wait_s}, wait_s=wait_s)
        self._note_floor(fields)
        return int(fields["granted"])

    async def put_group(self, group: Group) -> None:
        """The groups put in the same turn of the loop go as one put_group: a sync step's
        groups finish together (one batched /generate, rollout/coalesce.py), and 32 messages
        were 32 broker turns and spill records; one is acknowledged for all."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._puts:  # the first of this turn: send them all once the turn is over
            loop.call_soon(self._flush_puts)
        self._puts.append((group, done))
        await done

    def _flush_puts(self) -> None:
        puts, self._puts = self._puts, []
        message: list[tuple[Group, asyncio.Future[None]]] = []
        size = 0
        for put in puts:
            n = group_nbytes(put[0])
            if message and size + n > self.max_put_bytes:
                self._send_puts(message)
                message, size = [], 0
            message.append(put)
            size += n
        self._send_puts(message)

    def _send_puts(self, puts: list[tuple[Group, asyncio.Future[None]]]) -> None:
        task = asyncio.ensure_future(self._put_all(puts))
        self._put_sends.add(task)
        task.add_done_callback(self._put_sends.discard)

    async def _put_all(self, puts: list[tuple[Group, asyncio.Future[None]]]) -> None:
        try:
            fields, _ = await self._call("put_group", {}, [g for g, _ in puts])
            self._note_floor(fields)
        except asyncio.CancelledError:
            for _, done in puts:
                done.cancel()
            raise
        except Exception as e:  # every caller sees the message's failure
            for _, done in puts:
                if not done.done():
                    done.set_exception(e)
            return
        for _, done in puts:
            if not done.done():  # a caller cancelled meanwhile (shutdown) no longer waits
                done.set_result(None)

    async def release(self, n: int) -> None:
        await self._call("release", {"n": n})

    async def get_batch(self, num_groups: int, version: int, wait_s: float = 0.0,
                        min_groups: int | None = None) -> Batch | None:
        fields, groups = await self._call(
            "get_batch", {"num_groups": num_groups, "version": version, "wait_s": wait_s,
                          **({} if min_groups is None else {"min_groups": min_groups})},
            wait_s=wait_s)
        return _batch(fields, groups)

    async def set_version(self, version: int) -> None:
        await self._call("set_version", {"version": version})

    async def rejoin(self, rank: int) -> dict[str, Any]:
        """At start: reclaim the credits a dead predecessor of this client's name held; returns
        {reclaimed, position} (position: where that worker was in the data, or None)."""
        fields, _ = await self._call("rejoin", {"rank": rank})
        fields.pop("rid", None)
        return fields

    async def heartbeat(self, role: str, **info: Any) -> None:
        await self._call("heartbeat", {"role": role, "info": info})

    async def stats(self) -> BrokerStats:
        fields, _ = await self._call("stats", {})
        fields.pop("rid", None)
        return BrokerStats.from_dict(fields)

    async def shutdown(self) -> None:
        await self._call("shutdown", {})

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        for task in self._put_sends:
            task.cancel()
        for fut in self._pending.values():
            fut.cancel()
        self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Receives the broker's broadcasts: ('version', {'version': v}) and ('shutdown', {}).

    PUB/SUB drops what is published before the subscription reaches the broker, so a
    subscriber learns the current version from `BrokerClient.stats()` at start.
    """

    def __init__(self, pub_addr: str, topics: tuple[str, ...] = ("",)) -> None:
        self.addr = pub_addr
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        for topic in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(pub_addr)

    def poll(self, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
        """Everything received, waiting up to `timeout_s` for the first message."""
        out: list[tuple[str, dict[str, Any]]] = []
        wait_ms = max(0, int(timeout_s * 1000))
        while self._sock.poll(0 if out else wait_ms, zmq.POLLIN):
            frames = self._sock.recv_multipart()
            if len(frames) != 2:
                raise BrokerError(f"bad broadcast from {self.addr}: {len(frames)} frames")
            try:
                fields = msgpack.unpackb(frames[1], raw=False)
            except Exception as e:
                raise BrokerError(f"bad broadcast from {self.addr}: {e}") from e
            out.append((frames[0].decode(), fields))
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
