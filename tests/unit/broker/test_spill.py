"""The spill file: records survive a torn tail, compaction keeps the live state, and a broker
process killed with SIGKILL restarts in place (same version, counters, queue, credits in flight,
answers) while its clients' requests go through by themselves."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq

from relax_slurm.broker import AsyncBrokerClient
from relax_slurm.broker.spill import Spill, iter_records, pack_record, replay
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.wire import decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.runtime.ports import free_port
from tests.helpers_broker import SECRET, TIMEOUT_S, Broker, group


def test_records_round_trip_and_a_torn_tail_is_cut(tmp_path: Path) -> None:
    frames = [b"head", b"", b"x" * 1000]
    data = pack_record(frames) * 3
    assert [[bytes(f) for f in fr] for _, fr in iter_records(data)] == [frames] * 3
    for cut in (1, 7, 500):  # a crash in the middle of the last record
        assert len(list(iter_records(data[:-cut]))) == 2
    corrupt = bytearray(data)
    corrupt[-3] ^= 0xFF  # the CRC catches a flipped byte
    assert len(list(iter_records(bytes(corrupt)))) == 2


def test_spill_replays_the_state_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "spill.bin"
    state = BrokerState(max_staleness=1, batch_size=2)
    spill = Spill(path, compact_bytes=4000)
    spill.start(state)
    assert state.admit(4) == 4
    spill.record(state, (b"w", 1), {"granted": 4})
    for gid in range(3):
        state.accept(group(gid))
        spill.record(state, (b"w", 2 + gid), {})
    taken, stats = state.take_batch(2, 0)
    spill.record(state, (b"t", 1), {"stats": stats.to_dict()}, taken)
    before = path.stat().st_size
    for v in range(1, 30):  # grows the file past compact_bytes: rewritten as one snapshot
        state.set_version(v)
        spill.record(state)
    spill.close()
    got = replay(path)
    assert path.stat().st_size < before + 29 * 200 and got.records < 30
    assert got.snapshot == state.snapshot() and got.torn_bytes == 0
    assert [g[0].group_id for g in got.queue.values()] == []  # group 2 was dropped as stale
    assert state.counters()["dropped"] == 1


def test_replay_keeps_answers_and_queue(tmp_path: Path) -> None:
    path = tmp_path / "spill.bin"
    state = BrokerState(max_staleness=0, batch_size=3)
    spill = Spill(path)
    spill.start(state)
    state.admit(3)
    spill.record(state, (b"w", 1), {"granted": 3})
    for gid in range(3):
        state.accept(group(gid))
        spill.record(state, (b"w", 2 + gid), {})
    taken, stats = state.take_batch(2, 0)
    spill.record(state, (b"t", 9), {"stats": stats.to_dict()}, taken)
    with open(path, "ab") as f:
        f.write(b"RSP1\x00\x01")  # a torn record
    got = replay(path)
    assert got.torn_bytes == 6 and got.snapshot == state.snapshot()
    assert [g[0].group_id for g in got.queue.values()] == [2]
    answers = {(who, rid): (fields, groups) for who, rid, fields, groups in got.answers}
    assert answers[(b"w", 1)] == ({"granted": 3}, None)
    fields, groups = answers[(b"t", 9)]
    assert [g[0].group_id for g in groups] == [0, 1] and fields["stats"]["consumed"] == 2
    np.testing.assert_array_equal(groups[1][1].rollout_logprobs, taken[1][1].rollout_logprobs)
    # a writer continuing the file cuts the torn tail off first
    Spill(path, replayed=got).close()
    assert replay(path).torn_bytes == 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_killed_broker_restarts_in_place(start_broker: Callable[..., Broker],
                                           tmp_path: Path) -> None:
    spill = tmp_path / "broker" / "spill.bin"
    addrs = {"router": f"tcp://127.0.0.1:{free_port()}", "pub": f"tcp://127.0.0.1:{free_port()}"}
    broker = start_broker(max_staleness=1, batch_size=2, extra_args=("--spill", str(spill)),
                          **addrs)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-worker")
    raw.connect(broker.router)
    with broker.client("trainer") as trainer, broker.client("worker") as worker:
        trainer.set_version(0)
        assert worker.acquire(4) == 4
        for gid in (1, 2):
            worker.put_group(group(gid))
        raw.send_multipart(encode("put_group", {"rid": 7, "auth": SECRET}, [group(3)]))
        assert raw.poll(int(TIMEOUT_S * 1000)) and decode(raw.recv_multipart())[1]["rid"] == 7
        got = trainer.get_batch(2, 0)
        assert got is not None and [g[0].group_id for g in got[0]] == [1, 2]

        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(10)
        with open(spill, "ab") as f:
            f.write(b"RSP1 torn")  # as if the kill had cut a write short
        # a request sent while the broker is down goes through once it is back
        late: list[object] = []
        thread = threading.Thread(target=lambda: late.append(trainer.get_batch(2, 0, 20.0)))
        thread.start()
        again = start_broker(max_staleness=1, batch_size=2,
                             extra_args=("--spill", str(spill), "--replay"), **addrs)
        assert "torn bytes cut" in again.log.read_text()
        s = worker.stats().to_dict()
        assert {k: s[k] for k in ("version", "accepted", "consumed", "in_flight", "dropped")} == {
            "version": 0, "accepted": 3, "consumed": 2, "in_flight": 1, "dropped": 0}
        # the raw client's reply was "lost": its resend is answered again, not applied twice
        raw.send_multipart(encode("put_group", {"rid": 7, "auth": SECRET}, [group(3)]))
        assert raw.poll(int(TIMEOUT_S * 1000))
        op, fields, _ = decode(raw.recv_multipart())
        assert op == "ok" and fields["rid"] == 7 and worker.stats().counters.accepted == 3
        worker.put_group(group(4))  # the credit it held before the kill still counts
        thread.join(30)
        assert late and late[0] is not None
        assert [g[0].group_id for g in late[0][0]] == [3, 4]
        assert worker.stats().counters.queue_depth == 0
    raw.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_async_requests_ride_out_a_broker_restart(start_broker: Callable[..., Broker],
                                                  tmp_path: Path) -> None:
    spill = tmp_path / "broker" / "spill.bin"
    addrs = {"router": f"tcp://127.0.0.1:{free_port()}", "pub": f"tcp://127.0.0.1:{free_port()}"}
    args = ("--spill", str(spill))
    broker = start_broker(max_staleness=0, batch_size=2, extra_args=args, **addrs)
    with broker.client("trainer") as trainer:
        trainer.set_version(0)

    async def worker() -> dict:
        async with AsyncBrokerClient(broker.router, TIMEOUT_S * 4, "rollout0") as ac:
            assert await ac.acquire(2) == 2
            broker.proc.kill()  # the broker dies with credits out
            broker.proc.wait(10)
            # sent while it is down; answered by the restarted one
            puts = [asyncio.ensure_future(ac.put_group(group(gid))) for gid in (1, 2)]
            await asyncio.sleep(0.5)
            start_broker(max_staleness=0, batch_size=2, extra_args=(*args, "--replay"), **addrs)
            await asyncio.gather(*puts)
            return (await ac.stats()).to_dict()

    s = asyncio.run(worker())
    assert (s["accepted"], s["in_flight"], s["queue_depth"]) == (2, 0, 2)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rejoin_retires_the_dead_workers_late_puts(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=0, batch_size=4)
    with broker.client("trainer") as trainer, broker.client("rollout0") as dead, \
            broker.client("rollout0") as successor:
        trainer.set_version(0)
        assert dead.acquire(3) == 3
        dead.put_group(group(1))
        assert successor.rejoin(0) == {"reclaimed": 2, "position": None}
        assert successor.acquire(4) == 3  # 4 - 1 accepted
        with pytest.raises(BrokerError, match="replaced"):
            dead.put_group(group(2))  # sent before it died, read after the rejoin
        successor.put_group(group(3))
        s = trainer.stats().to_dict()
        assert (s["accepted"], s["in_flight"]) == (2, 2)


def test_spill_keeps_the_version_spans_of_queued_groups(tmp_path: Path) -> None:
    """A group whose samples span two versions (a sync mid-generation) replays with its spans."""
    path = tmp_path / "spill.bin"
    state = BrokerState(max_staleness=1, batch_size=1)
    spill = Spill(path)
    spill.start(state)
    state.admit(1)
    g = group(0, version=1)
    for s in g:
        s.version_min, s.version_spans = 0, [[0, 0, 1], [1, 1, s.response_len]][:s.response_len]
    state.accept(g)
    spill.record(state, (b"w", 1), {})
    spill.close()
    [got] = replay(path).queue.values()
    assert [s.version_spans for s in got] == [[[0, 0, 1]], [[0, 0, 1], [1, 1, 2]]]
