"""The broker's front door, on a real broker process: the run's secret, size limits, fuzzed
frames. None of them may crash it; a normal client is served afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax_slurm.auth import SECRET_ENV
from relax_slurm.broker import BrokerClient
from relax_slurm.broker.wire import decode, encode
from relax_slurm.config import save_config
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.errors import BrokerError
from tests.helpers_broker import REPO, SECRET, TIMEOUT_S, Broker, group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def dealer(router: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router)
    return sock


def reply(sock: zmq.Socket, timeout_s: float = TIMEOUT_S) -> tuple[str, dict, object] | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return decode(sock.recv_multipart())


def test_requests_without_the_secret_are_refused_and_counted(
        start_broker: Callable[..., Broker]) -> None:
    broker = start_broker()
    with BrokerClient(broker.router, TIMEOUT_S, secret="wrong") as intruder:
        for call in (intruder.stats, lambda: intruder.set_version(5), intruder.shutdown,
                     lambda: intruder.put_group(group(1))):
            with pytest.raises(BrokerError, match="unauthenticated"):
                call()
    sock = dealer(broker.router)
    try:
        for fields in ({"rid": 1}, {"rid": 2, "auth": None}, {"rid": 3, "auth": 12345},
                       {"rid": 4, "auth": SECRET + "x"}):
            sock.send_multipart(encode("stats", fields))
            op, got, _ = reply(sock)
            assert op == "error" and "unauthenticated" in got["error"]
            assert got["rid"] == fields["rid"]
    finally:
        sock.close()
    with broker.client() as ok:  # the run's secret from the environment
        s = ok.stats().to_dict()
        assert s["auth_refused"] == 8 and s["version"] == 0  # nothing happened
        assert "auth" not in s
    assert broker.proc.poll() is None


def test_a_broker_without_a_secret_does_not_start(tmp_path: Path) -> None:
    save_config(TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="x"),
                            data=DataConfig(train_files=["x"])), tmp_path / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-m", "relax_slurm.broker", "--config", str(tmp_path / "config.yaml"),
         "--router", "tcp://127.0.0.1:*", "--pub", "tcp://127.0.0.1:*"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and SECRET_ENV in out.stderr, out.stderr


def test_oversized_messages_are_dropped(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_message_mb=1)
    sock = dealer(broker.router)
    try:
        sock.send_multipart([msgpack.packb({"op": "stats", "f": {"auth": SECRET}, "g": None}),
                             b"\0" * (2 << 20)])
        assert reply(sock, 1.0) is None  # ZMQ disconnected the peer; nothing reached the loop
    finally:
        sock.close()
    with broker.client() as ok:
        assert ok.stats().counters.version == 0
    assert broker.proc.poll() is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
_ops = st.sampled_from(["acquire", "put_group", "release", "get_batch", "set_version",
                        "heartbeat", "stats", "nope", ""])
# authenticated headers with random fields reach every handler; random bytes reach decode
_header = st.builds(
    lambda op, f, g, auth: msgpack.packb(
        {"op": op, "f": {**f, **({"auth": SECRET} if auth else {})}, "g": g},
        use_bin_type=True),
    _ops, st.dictionaries(st.sampled_from(["rid", "max_n", "wait_s", "n", "num_groups",
                                           "version", "role"]), _json, max_size=4),
    st.none() | st.lists(_json, max_size=2), st.booleans())
_message = st.lists(st.binary(max_size=64), min_size=1, max_size=4) | st.tuples(
    _header, st.lists(st.binary(max_size=64), max_size=3)).map(lambda t: [t[0], *t[1]])


def test_fuzzed_frames_never_crash_the_broker(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=1, batch_size=2)
    sock = dealer(broker.router)

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_message)
    def send(frames: list[bytes]) -> None:
        # a shutdown is the one request allowed to stop the broker; wait_s could park
        msg = frames[0]
        if b"shutdown" in msg:
            return
        sock.send_multipart(frames)
        while sock.poll(0):
            sock.recv_multipart()

    try:
        send()
        # whatever the fuzz left parked expires within wait_s; the broker answers anyway
        assert broker.proc.poll() is None, broker.log.read_text()
        with broker.client("after-fuzz") as ok:
            assert ok.stats().auth_refused > 0
    finally:
        sock.close()
    assert broker.proc.poll() is None
    assert "Traceback" not in broker.log.read_text(), broker.log.read_text()


def test_admin_status_needs_the_secret_and_shows_the_run(
        start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(max_staleness=1, batch_size=2, admin=True)
    assert broker.admin and broker.admin.startswith("http://127.0.0.1:")
    ok = {"Authorization": f"Bearer {SECRET}"}
    with httpx.Client(base_url=broker.admin, timeout=TIMEOUT_S) as http:
        assert http.get("/status").status_code == 401
        assert http.get("/status", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/nope", headers=ok).status_code == 404
        assert http.post("/status", headers=ok).status_code == 405
        with broker.client("trainer") as trainer, broker.client("worker") as worker:
            trainer.set_version(3)
            worker.heartbeat("rollout0", groups_in_flight=2)
            trainer.heartbeat("trainer", step=3)
            assert worker.acquire(1) == 1
            worker.put_group(group(1, version=3))
            status = http.get("/status", headers=ok).json()
    assert status["version"] == 3 and status["queue_depth"] == 1 and status["in_flight"] == 0
    assert status["counters"]["accepted"] == 1 and status["auth_refused"] == 2
    assert status["roles"]["rollout0"]["groups_in_flight"] == 2
    assert status["roles"]["trainer"]["step"] == 3
    assert 0 <= status["roles"]["trainer"]["heartbeat_age_s"] < 5
    assert status["pid"] == broker.proc.pid
