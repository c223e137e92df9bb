"""The launcher's side of elastic rollout (launch/scale.py) against a real broker and a real hf
engine started outside the run: external registration through every scale-out state, a
scale-in that only forgets the server (it is not the run's to stop), a scale-out to a
server that never answers failing at its timeout, and a registered server that stops answering
reported lost."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.runtime.plan import RunPlan, save_plan
from relax_slurm.runtime.ports import free_port
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.launch.scale import Scaler
from tests.helpers_tiny import start_engine, stop_process, wait_healthy
from tests.helpers_broker import SECRET, TIMEOUT_S, Broker

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


@dataclass
class External:
    """A real broker (the launch's engine: INITIAL, never started), a real hf engine started
    outside the run at `url`, and the launcher's Scaler over them."""
    broker: Broker
    url: str
    engine: subprocess.Popen
    log: Path
    procs: ProcessSet
    scaler: Scaler

    def admin(self, route: str, body: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {SECRET}"}
        if body is None:
            return httpx.get(self.broker.admin + route, headers=headers,
                             timeout=TIMEOUT_S).json()
        return httpx.post(self.broker.admin + route, json=body, headers=headers,
                          timeout=TIMEOUT_S).json()

    def join(self) -> str:
        """Register the engine and take it through every state to ACTIVE; its op id."""
        rid = self.admin("/rollout/scale_out", {"engine_urls": [self.url]})["request_id"]
        wait_healthy(self.url, self.engine, 120, self.log)
        op = tick_until(self.scaler, self.admin, rid, "WEIGHT_SYNCING")
        assert op["history"] == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING"], op
        with self.broker.client() as trainer:  # what trainer rank 0 reports after its push
            assert trainer.engines()["cohort"] == [INITIAL, self.url]
            trainer.engines(synced=[INITIAL, self.url])
        assert self.admin(f"/rollout/scale_out/{rid}")["status"] == "ACTIVE"
        return rid


@pytest.fixture
def external(start_broker: Callable[..., Broker], tmp_path: Path, tiny_assets: Path
             ) -> Iterator[Callable[..., External]]:
    """external(**restart): the set-up above, with these `cluster.restart.*` values; stopped
    after."""
    made: list[External] = []

    def make(**restart: object) -> External:
        save_plan(RunPlan(broker_router="tcp://x:1", broker_pub="tcp://x:2",
                          engine_urls=[INITIAL]), tmp_path)
        broker = start_broker(admin=True)
        port, log = free_port(), tmp_path / "external.log"
        engine = start_engine(tiny_assets / "model", port, log)
        cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="x"),
                          data=DataConfig(train_files=["x"]))
        for key, value in restart.items():
            setattr(cfg.cluster.restart, key, value)
        (tmp_path / "logs").mkdir(exist_ok=True)
        procs = ProcessSet(tmp_path / "logs", {})
        made.append(External(broker, f"http://127.0.0.1:{port}", engine, log, procs,
                             Scaler(procs, cfg, tmp_path, broker.admin, SECRET,
                                    wrap=lambda spec: spec.argv)))
        return made[-1]

    try:
        yield make
    finally:
        for x in made:
            x.scaler.close()
            x.procs.close()
            stop_process(x.engine)


def test_external_engine_joins_and_leaves(external: Callable[..., External]) -> None:
    ext = external()
    admin, url = ext.admin, ext.url
    # a server that never answers: HEALTH_CHECKING until timeout_secs, then FAILED
    dead = admin("/rollout/scale_out", {"engine_urls": ["http://127.0.0.1:9"],
                                        "timeout_secs": 1.5})["request_id"]
    op = tick_until(ext.scaler, admin, dead, "FAILED", timeout_s=30)
    assert op["status"] == "FAILED" and "timeout_secs" in op["error"], op
    ext.scaler.tick()  # stops nothing (not ours), forgets it
    assert [e["url"] for e in admin("/rollout/engines")["engines"]] == [INITIAL]
    # the real engine: registered, health-checked, then the trainer's sync makes it active
    rid = ext.join()
    assert admin(f"/rollout/scale_out/{rid}")["mode"] == "external"
    assert ext.procs.roles == []  # nothing started
    assert admin("/rollout/engines")["routable"] == [INITIAL, url]
    # scale in: drained, out of the cohort, then forgotten; the server keeps running
    sid = admin("/rollout/scale_in", {"engine_urls": [url]})["request_id"]
    with ext.broker.client() as worker:
        worker.engines(drained=[url])
        worker.engines(synced=[INITIAL])
    ext.scaler.tick()
    assert admin(f"/rollout/scale_in/{sid}")["status"] == "COMPLETED"
    assert ext.engine.poll() is None
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_an_external_engine_that_stops_answering_is_lost(external: Callable[..., External],
                                                         tmp_path: Path) -> None:
    ext = external(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0)
    admin, url, scaler = ext.admin, ext.url, ext.scaler
    ext.join()
    # answering: several probes past the timeout leave it in the run
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        scaler.tick()
        time.sleep(0.2)
    assert admin("/rollout/engines")["routable"] == [INITIAL, url]
    # ... and the last probe found it answering: a probe slowed past its timeout on a loaded
    # machine starts the silence before the kill (ticks run only here, so none runs between)
    while url in scaler._silent_since:
        assert time.monotonic() < deadline + 60, "a live engine never answered a probe"
        scaler.tick()
        time.sleep(0.2)
    stop_process(ext.engine)  # it stops answering
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
