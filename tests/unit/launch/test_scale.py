"""The launcher's side of elastic rollout (launch/scale.py) against a real broker and a real hf
engine started outside the run: external registration through every scale-out state, a
scale-in that only forgets the server (it is not the run's to stop), and a scale-out to a
server that never answers failing at its timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from relax_slurm.config.schema import DataConfig, ModelConfig, TrainConfig
from relax_slurm.launch.plan import RunPlan, free_port, save_plan
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.launch.scale import Scaler
from tests.helpers_tiny import start_engine, stop_process, wait_healthy
from tests.unit.broker.test_server import (  # noqa: F401  (start_broker is a fixture)
    SECRET, TIMEOUT_S, Broker, start_broker,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
INITIAL = "http://127.0.0.1:1"


def tick_until(scaler: Scaler, admin: Callable[[str], dict], rid: str, status: str,
               timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        scaler.tick()
        op = admin(f"/rollout/scale_out/{rid}")
        if op["status"] == status or time.monotonic() > deadline:
            return op
        time.sleep(0.2)


def test_external_engine_joins_and_leaves(start_broker: Callable[..., Broker], tmp_path: Path,
                                          tiny_assets: Path) -> None:
    save_plan(RunPlan(broker_router="tcp://x:1", broker_pub="tcp://x:2", engine_urls=[INITIAL]),
              tmp_path)
    broker = start_broker(admin=True)
    headers = {"Authorization": f"Bearer {SECRET}"}

    def admin(route: str, body: dict | None = None) -> dict:
        if body is None:
            return httpx.get(broker.admin + route, headers=headers, timeout=TIMEOUT_S).json()
        return httpx.post(broker.admin + route, json=body, headers=headers,
                          timeout=TIMEOUT_S).json()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(tiny_assets / "model", port, tmp_path / "external.log")
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="x"),
                      data=DataConfig(train_files=["x"]))
    (tmp_path / "logs").mkdir(exist_ok=True)
    procs = ProcessSet(tmp_path / "logs", {})
    scaler = Scaler(procs, cfg, tmp_path, broker.admin, SECRET, wrap=lambda spec: spec.argv)
    try:
        # a server that never answers: HEALTH_CHECKING until timeout_secs, then FAILED
        dead = admin("/rollout/scale_out", {"engine_urls": ["http://127.0.0.1:9"],
                                            "timeout_secs": 1.5})["request_id"]
        op = tick_until(scaler, admin, dead, "FAILED", timeout_s=30)
        assert op["status"] == "FAILED" and "timeout_secs" in op["error"], op
        scaler.tick()  # stops nothing (not ours), forgets it
        assert [e["url"] for e in admin("/rollout/engines")["engines"]] == [INITIAL]
        # the real engine: registered, health-checked, then the trainer's sync makes it active
        rid = admin("/rollout/scale_out", {"engine_urls": [url]})["request_id"]
        wait_healthy(url, engine, 120, tmp_path / "external.log")
        op = tick_until(scaler, admin, rid, "WEIGHT_SYNCING")
        assert op["history"] == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING"], op
        assert op["mode"] == "external" and procs.roles == []  # nothing started
        with broker.client() as trainer:  # what trainer rank 0 reports after its push
            assert trainer.engines()["cohort"] == [INITIAL, url]
            trainer.engines(synced=[INITIAL, url])
        assert admin(f"/rollout/scale_out/{rid}")["status"] == "ACTIVE"
        assert admin("/rollout/engines")["routable"] == [INITIAL, url]
        # scale in: drained, out of the cohort, then forgotten; the server keeps running
        sid = admin("/rollout/scale_in", {"engine_urls": [url]})["request_id"]
        with broker.client() as worker:
            worker.engines(drained=[url])
            worker.engines(synced=[INITIAL])
        scaler.tick()
        assert admin(f"/rollout/scale_in/{sid}")["status"] == "COMPLETED"
        assert engine.poll() is None
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        scaler.close()
        procs.close()
        stop_process(engine)


def test_an_external_engine_that_stops_answering_is_lost(start_broker: Callable[..., Broker],
                                                         tmp_path: Path, tiny_assets: Path
                                                         ) -> None:
    save_plan(RunPlan(broker_router="tcp://x:1", broker_pub="tcp://x:2", engine_urls=[INITIAL]),
              tmp_path)
    broker = start_broker(admin=True)
    headers = {"Authorization": f"Bearer {SECRET}"}

    def admin(route: str, body: dict | None = None) -> dict:
        if body is None:
            return httpx.get(broker.admin + route, headers=headers, timeout=TIMEOUT_S).json()
        return httpx.post(broker.admin + route, json=body, headers=headers,
                          timeout=TIMEOUT_S).json()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(tiny_assets / "model", port, tmp_path / "external.log")
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="x"),
                      data=DataConfig(train_files=["x"]))
    cfg.cluster.heartbeat_interval_s, cfg.cluster.heartbeat_timeout_s = 1.0, 3.0
    procs = ProcessSet(tmp_path / "logs", {})
    scaler = Scaler(procs, cfg, tmp_path, broker.admin, SECRET, wrap=lambda spec: spec.argv)
    try:
        rid = admin("/rollout/scale_out", {"engine_urls": [url]})["request_id"]
        wait_healthy(url, engine, 120, tmp_path / "external.log")
        tick_until(scaler, admin, rid, "WEIGHT_SYNCING")
        with broker.client() as trainer:
            trainer.engines(synced=[INITIAL, url])
        # answering: several probes past the timeout leave it in the run
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            scaler.tick()
            time.sleep(0.2)
        assert admin("/rollout/engines")["routable"] == [INITIAL, url]
        stop_process(engine)  # it stops answering
        killed = time.monotonic()
        deadline = killed + 60
        while url in [e["url"] for e in admin("/rollout/engines")["engines"]]:
            assert time.monotonic() < deadline, admin("/rollout/engines")
            scaler.tick()
            time.sleep(0.2)
        assert time.monotonic() - killed >= 3.0  # not before heartbeat_timeout_s
        view = admin("/rollout/engines")
        assert view["routable"] == [INITIAL] and view["cohort"] == [INITIAL]
        [row] = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
        assert row["kind"] == "lost" and row["url"] == url and "heartbeat_timeout_s" in row["cause"]
        assert scaler.counts() == {}  # lost, not restarted
    finally:
        scaler.close()
        procs.close()
        stop_process(engine)
