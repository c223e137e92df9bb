"""Elastic rollout on the real topology (relax-train, tiny experiment, one trainer rank), one
run: scale out from 1 to 3 engines mid-run through the broker's admin HTTP (the launcher starts
the engines, the trainer's cohort re-forms and sends them the current weights, the worker
routes to them once ACTIVE: each serves a share of the requests), then scale in to 1 with
drain (no request lost), then a scale-out cancelled at once (rolled back: its engine is
stopped), then an engine started outside the run registered by URL (it gets the weights and
generates; scaled in, it is forgotten, not stopped). Then the run is stopped on request
(runtime/control.py `request_stop`: its length is no guess at when the last operation ends)
and ends finished with samples_lost 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from relax_slurm.runtime.control import request_stop
from relax_slurm.runtime.ports import free_port
from tests.conftest import ONE_RANK
from tests.helpers_tiny import start_engine, stop_process, wait_healthy
from tests.integration.test_chaos import TIMEOUT_S, finish, role, start, stop, wait_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
OP_WAIT_S = 400


class Admin:
    def __init__(self, run_dir: Path) -> None:
        plan = json.loads((run_dir / "plan.json").read_text())
        self.url = plan["broker_admin"]
        self.headers = {"Authorization": f"Bearer {(run_dir / 'secret').read_text().strip()}"}

    def get(self, route: str) -> dict:
        return httpx.get(self.url + route, headers=self.headers, timeout=10).json()

    def post(self, route: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(self.url + route, json=body, headers=self.headers, timeout=10)

    def wait(self, rid: str, proc) -> dict:
        deadline = time.monotonic() + OP_WAIT_S
        while True:
            op = self.get(f"/rollout/scale_out/{rid}")
            if op["status"] in ("ACTIVE", "COMPLETED", "FAILED", "CANCELLED"):
                return op
            assert proc.poll() is None and time.monotonic() < deadline, op
            time.sleep(0.2)


def engine_version(url: str, secret: str) -> int:
    return int(httpx.get(url + "/model_info", timeout=10,
                         headers={"Authorization": f"Bearer {secret}"}).json()["weight_version"])


def wait_requests(admin: Admin, proc, urls: list[str], n: int = 2) -> None:
    """Until the worker has sent `n` requests to each of `urls` (its per-engine counts).
    Throughput is not asserted here: on 2 shared cores more engines barely raise it (measured
    by tools/bench, part 7 `engines`, in docs/benchmarks.md)."""
    deadline = time.monotonic() + OP_WAIT_S
    while min(admin.get("/status")["roles"]["rollout"].get(
            "requests_per_engine", {}).get(url, 0) for url in urls) < n:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)


def external_engine_joins_and_leaves(admin: Admin, proc, engine, url: str, secret: str,
                                     log: Path) -> None:
    """An engine started outside the run (`engine` at `url`, with the run's secret as its API
    key), registered by URL: it gets the trainer's weights and generates for the run; scaled
    in, the run forgets it and leaves it running (not its process)."""
    wait_healthy(url, engine, OP_WAIT_S, log)
    r = admin.post("/rollout/scale_out", {"engine_urls": [url]})
    assert r.status_code == 202, r.text
    op = admin.wait(r.json()["request_id"], proc)
    assert op["status"] == "ACTIVE" and op["mode"] == "external", op
    assert engine_version(url, secret) >= 1  # the trainer's weights, not model.path's
    wait_requests(admin, proc, [url])
    r = admin.post("/rollout/scale_in", {"engine_urls": [url]})
    assert r.status_code == 202, r.text
    assert admin.wait(r.json()["request_id"], proc)["status"] == "COMPLETED"
    assert url not in [e["url"] for e in admin.get("/rollout/engines")["engines"]]
    assert engine.poll() is None


def test_scale_out_1_to_3_then_drain_in_then_cancel(tmp_path, tiny_assets):
    # more steps than the operations take (the last ended near step 49 at a load of 5-9 on 2
    # cores); the run is stopped on request once they are done
    run_dir, steps = tmp_path / "run", 2000
    # a step's batch in 8 requests, so that every engine gets a share of each step
    proc = start(run_dir, tiny_assets, ONE_RANK, f"trainer.total_steps={steps}",
                 "rollout.groups_per_request=4", "cluster.restart.heartbeat_interval_s=1",
                 "cluster.elastic.drain_timeout_s=120")
    engine = None
    try:
        wait_steps(proc, run_dir, 2)
        admin = Admin(run_dir)
        secret = (run_dir / "secret").read_text().strip()
        # the external engine (the last operation) loads while the ones before it run, rather
        # than after them with the run's steps going on meanwhile
        port = free_port()
        external, log = f"http://127.0.0.1:{port}", tmp_path / "external.log"
        engine = start_engine(tiny_assets / "model", port, log, api_key=secret)
        [first] = json.loads((run_dir / "plan.json").read_text())["engine_urls"]
        # scale out 1 -> 3: accepted, one at a time, the trainer syncs them, the worker routes
        r = admin.post("/rollout/scale_out", {"num_replicas": 3, "timeout_secs": OP_WAIT_S})
        assert r.status_code == 202, r.text
        rid = r.json()["request_id"]
        version_at_request = admin.get("/status")["version"]
        assert admin.post("/rollout/scale_out", {"num_replicas": 4}).status_code == 409
        op = admin.wait(rid, proc)
        assert op["status"] == "ACTIVE", op
        assert op["history"] == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING",
                                 "ACTIVE"]
        new = op["urls"]
        assert len(new) == 2
        # it serves the trainer's weights (not model.path's version 0) from its first request
        for url in new:
            assert engine_version(url, secret) >= max(version_at_request, 1)
        assert admin.get("/rollout/engines")["routable"] == [first, *new]
        assert admin.post("/rollout/scale_out", {"num_replicas": 3}).json()["noop"] is True
        assert role(run_dir, "engine1")["ports"]["http"] == int(new[0].rsplit(":", 1)[1])
        wait_requests(admin, proc, new)  # the new engines generate for the run
        # scale in to 1: the initial engine is protected, the new one drains and stops
        r = admin.post("/rollout/scale_in", {"engine_urls": [first]})
        assert r.status_code == 409 and "protected" in r.text
        r = admin.post("/rollout/scale_in", {"num_replicas": 1})
        assert r.status_code == 202 and r.json()["remove"] == new, r.text
        op = admin.wait(r.json()["request_id"], proc)
        assert op["status"] == "COMPLETED" and "DETACHING" in op["history"], op
        assert "drain timeout" not in " ".join(op["history"])  # drained, not cut off
        assert admin.get("/rollout/engines")["routable"] == [first]
        names = [x["name"] for x in json.loads((run_dir / "roles.json").read_text())]
        assert "engine1" not in names and "engine2" not in names
        # a scale-out cancelled at once rolls back: its engine process is stopped
        rid = admin.post("/rollout/scale_out", {"num_replicas": 2}).json()["request_id"]
        assert admin.post(f"/rollout/scale_out/{rid}/cancel").json()["status"] == "CANCELLED"
        deadline = time.monotonic() + 60
        while len(admin.get("/rollout/engines")["engines"]) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        external_engine_joins_and_leaves(admin, proc, engine, external, secret, log)
        request_stop(run_dir, "operations done")
        _, err = finish(proc)
    finally:
        stop(proc)
        stop_process(engine)
    assert "elastic rollout" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = summary["steps"]
    assert summary["stopped_early"] == {"at_step": reached, "total_steps": steps,
                                        "reason": "operations done"}, summary
    assert 2 < reached < steps and summary["samples_lost"] == 0, summary
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "weight-sync cohort: engines" in trainer_log
