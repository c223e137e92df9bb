"""The broker as a real process (`python -m relax_slurm.broker`) driven by the clients."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from relax_slurm.broker import AsyncBrokerClient, BrokerClient, Subscriber
from relax_slurm.broker.spill import iter_records
from relax_slurm.broker.wire import decode, encode, group_nbytes
from relax_slurm.errors import BrokerError, BrokerShutdown, BrokerTimeout
from tests.helpers_broker import SECRET, TIMEOUT_S, Broker, group, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
def send_malformed(router: str) -> None:
    """Garbage and invalid requests get error replies; the broker keeps serving."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router)
    try:
        for frames in ([b"\xc1not msgpack"], encode("nope", {"rid": 1, "auth": SECRET}),
                       encode("acquire", {"rid": 2, "max_n": "x", "wait_s": 0, "auth": SECRET}),
                       encode("put_group", {"rid": 3, "auth": SECRET}),
                       [msgpack.packb({"op": "put_group", "f": {}, "g": [[{}]]})]):
            sock.send_multipart(frames)
            assert sock.poll(int(TIMEOUT_S * 1000)), "no reply"
            op, fields, _ = decode(sock.recv_multipart())
            assert op == "error" and fields["error"], fields
    finally:
        sock.close()


def assert_times_out(router: str) -> None:
    with BrokerClient(router, 0.3) as c:
        with pytest.raises(BrokerTimeout, match=rf"'stats'.*{re.escape(router)}"):
            c.stats()
        with pytest.raises(BrokerTimeout, match="'get_batch'"):
            c.get_batch(1, 0, wait_s=0.1)

    async def main() -> None:
        async with AsyncBrokerClient(router, 0.3) as ac:
            with pytest.raises(BrokerTimeout, match="'acquire'"):
                await ac.acquire(1)
    asyncio.run(main())


def test_every_op_errors_and_a_killed_broker(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=1, batch_size=2)
    with broker.client("trainer") as trainer, broker.client("worker-0") as worker:
        worker.heartbeat("rollout")
        # a run's broker is closed until the trainer announces its (pushed) weights
        assert worker.acquire(10) == 0
        trainer.set_version(0)
        assert worker.acquire(10) == 4  # (1 + 0 + 1) * 2
        sent = [group(1), group(2, n=3)]
        for g in sent:
            worker.put_group(g)
        worker.release(2)
        batch = trainer.get_batch(2, 0)
        assert batch is not None
        groups, stats = batch
        for a, b in zip(sent, groups, strict=True):
            assert [(s.prompt_id, s.reward, s.metadata) for s in a] == \
                   [(s.prompt_id, s.reward, s.metadata) for s in b]
            for sa, sb in zip(a, b):
                np.testing.assert_array_equal(sa.rollout_logprobs, sb.rollout_logprobs)
        assert stats.staleness_hist == {0: 5} and stats.counters.consumed == 2
        assert stats.wait_s == 0.0
        trainer.set_version(1)
        s = trainer.stats().to_dict()
        assert {k: s[k] for k in ("version", "accepted", "consumed", "in_flight", "released",
                                  "queue_depth", "dropped")} == {
            "version": 1, "accepted": 2, "consumed": 2, "in_flight": 0, "released": 2,
            "queue_depth": 0, "dropped": 0}
        assert 0 <= s["heartbeat_age_s"]["rollout"] < 5
        with pytest.raises(BrokerError, match="only move forward"):
            trainer.set_version(0)
        with pytest.raises(BrokerError, match="in flight"):
            worker.release(100)
        with pytest.raises(BrokerError, match="without a credit"):
            worker.put_group(group(3))
        send_malformed(broker.router)
        assert trainer.stats().counters.version == 1  # still serving
    assert "broker: version 1" in broker.log.read_text()
    broker.proc.kill()
    broker.proc.wait(10)
    assert_times_out(broker.router)


def test_parked_requests_wake_and_expire(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=0, batch_size=1)
    results: dict[str, object] = {}
    with broker.client("trainer") as trainer, broker.client("worker") as worker:
        # deadlines: nothing to grant, nothing to hand out
        trainer.set_version(0)  # opens admission
        t0 = time.monotonic()
        assert worker.acquire(1) == 1
        assert worker.acquire(1, wait_s=0.3) == 0
        assert trainer.get_batch(1, 0, wait_s=0.3) is None
        assert 0.5 <= time.monotonic() - t0 < 15  # loose: a loaded CI machine

        # a parked get_batch is answered by the next put
        def get() -> None:
            with broker.client("trainer-thread") as c:
                results["batch"] = c.get_batch(1, 0, wait_s=10)
        th = threading.Thread(target=get)
        th.start()
        wait_for(lambda: trainer.stats().parked_get_batch == 1)
        worker.put_group(group(1))
        th.join(15)
        groups, stats = results["batch"]  # type: ignore[misc]
        assert groups[0][0].group_id == 1 and stats.wait_s > 0


        # a parked acquire is answered by set_version (the budget grows by batch_size)
        def acquire() -> None:
            with broker.client("worker-thread") as c:
                results["granted"] = c.acquire(3, wait_s=10)
        th = threading.Thread(target=acquire)
        th.start()
        wait_for(lambda: trainer.stats().parked_acquires == 1)
        trainer.set_version(1)
        th.join(15)
        assert results["granted"] == 1
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.proc.wait(10) == 0
    log = broker.log.read_text()
    assert "broker: version 1" in log and "SIGTERM" in log


def test_a_streaming_take(start_broker: Callable[..., Broker]) -> None:
    """get_batch with min_groups stays parked until that many groups are queued, then takes
    every queued one (up to num_groups); a min_groups above num_groups is refused."""
    broker = start_broker(max_staleness=1, batch_size=3)
    results: dict[str, object] = {}
    with broker.client("trainer") as trainer, broker.client("worker") as worker:
        trainer.set_version(0)
        assert worker.acquire(3) == 3

        def take_some() -> None:
            with broker.client("trainer-thread") as c:
                results["some"] = c.get_batch(3, 0, wait_s=10, min_groups=2)
        th = threading.Thread(target=take_some)
        th.start()
        wait_for(lambda: trainer.stats().parked_get_batch == 1)
        worker.put_group(group(2))
        assert trainer.stats().parked_get_batch == 1  # one of two: still parked
        worker.put_group(group(3))
        th.join(15)
        groups, _ = results["some"]  # type: ignore[misc]
        assert [g[0].group_id for g in groups] == [2, 3]
        with pytest.raises(BrokerError, match="min_groups=4 > num_groups=3"):
            trainer.get_batch(3, 0, min_groups=4)


def check_shutdown_broadcast(broker: Broker) -> None:
    sub = Subscriber(broker.pub)
    try:
        with broker.client() as c:
            # PUB/SUB drops messages until the subscription lands: bump versions until one shows
            seen: list[tuple[str, dict]] = []
            for v in range(2, 100):
                c.set_version(v)
                seen = sub.poll(0.1)
                if seen:
                    break
            assert seen and seen[0][0] == "version" and seen[0][1]["version"] >= 1
            c.shutdown()
        msgs = sub.poll(5.0)
        assert ("shutdown", {}) in msgs
        assert broker.proc.wait(10) == 0
    finally:
        sub.close()


def test_async_concurrency_and_shutdown(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=0, batch_size=50)

    async def main() -> None:
        async with AsyncBrokerClient(broker.router, TIMEOUT_S, "workers") as workers, \
                AsyncBrokerClient(broker.router, TIMEOUT_S, "trainer") as trainer:
            version = 0
            await trainer.set_version(0)  # opens admission

            async def work(gid: int) -> None:
                assert await workers.acquire(1, wait_s=20) == 1
                await workers.put_group(group(gid, version))
            # 60 prompts for a budget of 50: ten wait for the next version
            tasks = [asyncio.create_task(work(i)) for i in range(60)]
            batch = await trainer.get_batch(50, 0, wait_s=20)
            assert batch is not None
            assert len({g[0].group_id for g in batch[0]}) == 50
            assert (await trainer.stats()).parked_acquires == 10
            version = 1
            await trainer.set_version(1)
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
            assert await trainer.get_batch(50, 1) is None  # only ten queued
            assert (await trainer.stats()).counters.queue_depth == 10
    asyncio.run(main())
    check_shutdown_broadcast(broker)


def test_groups_put_in_one_turn_travel_as_one_message(start_broker: Callable[..., Broker],
                                                     tmp_path: Path) -> None:
    """A sync step's groups finish together: their puts go as one message (one broker turn,
    one spill record), and each caller hears the message's outcome, failure included; a
    message stays under the client's byte cap (the broker drops one over
    broker.max_message_mb unread), a group over it going alone."""
    spill = tmp_path / "spill.bin"
    broker = start_broker(max_staleness=0, batch_size=16, extra_args=("--spill", str(spill)))
    bad = group(9)
    bad[1].metadata = {"worker": 0, "wrker": 1}
    cap = 3 * group_nbytes(group(0))

    async def main() -> None:
        async with AsyncBrokerClient(broker.router, TIMEOUT_S, "workers") as workers, \
                AsyncBrokerClient(broker.router, TIMEOUT_S, "capped",
                                  max_put_bytes=cap) as capped, \
                AsyncBrokerClient(broker.router, TIMEOUT_S, "trainer") as trainer:
            await trainer.set_version(0)
            assert await workers.acquire(8) == 8 and await capped.acquire(8) == 8
            refused = await asyncio.gather(workers.put_group(group(0)), workers.put_group(bad),
                                           return_exceptions=True)
            assert all(isinstance(e, BrokerError) and "wrker" in str(e) for e in refused)
            assert (await trainer.stats()).counters.queue_depth == 0  # all or none
            await asyncio.gather(*(workers.put_group(group(gid)) for gid in range(8)))
            assert (await trainer.stats()).counters.queue_depth == 8
            await asyncio.gather(*(capped.put_group(group(gid)) for gid in range(8, 16)))
            assert (await trainer.stats()).counters.queue_depth == 16
    asyncio.run(main())
    puts = [gs for _, frames in iter_records(spill.read_bytes())
            for _, _, gs in [decode(frames)] if gs]
    assert [len(gs) for gs in puts] == [8, 3, 3, 2], [len(gs) for gs in puts]


def test_a_parked_request_learns_of_shutdown(start_broker: Callable[..., Broker]) -> None:
    """SIGTERM refuses parked requests with BrokerShutdown, which a worker takes as 'stop
    quietly' rather than a failure worth a traceback."""
    broker = start_broker()
    errors: list[BaseException] = []

    def park() -> None:
        with broker.client("worker", timeout_s=30) as c:
            try:
                c.acquire(1, wait_s=20)  # admission is closed until a set_version: parks
            except BrokerError as e:
                errors.append(e)
    t = threading.Thread(target=park)
    t.start()
    with broker.client() as c:  # the acquire is parked once the broker reports it
        deadline = time.monotonic() + 10
        while c.stats().parked_acquires == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    broker.proc.send_signal(signal.SIGTERM)
    t.join(20)
    assert len(errors) == 1 and isinstance(errors[0], BrokerShutdown), errors
    assert "shutting down" in str(errors[0])
