"""The elastic rollout's HTTP contract on a real broker process (admin HTTP /rollout/...):
auth, bad input, 409 one-at-a-time, no-op targets, protected engines, the launcher's and the
trainer's and worker's reports moving operations to their end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from relax_slurm.runtime.plan import RunPlan, save_plan
from tests.helpers_broker import SECRET, TIMEOUT_S, Broker

pytestmark = [pytest.mark.timeout(120)]
A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


@pytest.fixture
def broker(start_broker: Callable[..., Broker], tmp_path: Path) -> Broker:
    # the broker reads the launch's engines from plan.json beside its config
    save_plan(RunPlan(broker_router="tcp://x:1", broker_pub="tcp://x:2", engine_urls=[A]),
              tmp_path)
    return start_broker(admin=True)


def call(broker: Broker, method: str, route: str, body: object = None,
         token: str | None = SECRET) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, broker.admin + route, json=body, headers=headers,
                         timeout=TIMEOUT_S)


def test_contract(broker: Broker) -> None:
    assert call(broker, "GET", "/rollout/engines", token=None).status_code == 401
    assert call(broker, "POST", "/rollout/scale_out", {"num_replicas": 2},
                token="wrong").status_code == 401
    view = call(broker, "GET", "/rollout/engines").json()
    assert [e["url"] for e in view["engines"]] == [A] and view["engines"][0]["origin"] == "initial"
    # no-op, bad input
    r = call(broker, "POST", "/rollout/scale_out", {"num_replicas": 1})
    assert r.status_code == 200 and r.json()["noop"] is True
    for bad in ({}, {"num_replicas": "two"}, {"num_replicas": 2, "engine_urls": [B]}, [1]):
        assert call(broker, "POST", "/rollout/scale_out", bad).status_code == 400, bad
    r = httpx.post(broker.admin + "/rollout/scale_out", content=b"{not json",
                   headers={"Authorization": f"Bearer {SECRET}"}, timeout=TIMEOUT_S)
    assert r.status_code == 400
    assert call(broker, "GET", "/rollout/scale_out/nope").status_code == 404
    assert call(broker, "POST", "/rollout/nowhere", {}).status_code == 404
    # a scale-out: accepted, then one at a time
    r = call(broker, "POST", "/rollout/scale_out", {"num_replicas": 3, "timeout_secs": 60})
    assert r.status_code == 202 and r.json()["status"] == "PENDING"
    rid = r.json()["request_id"]
    r = call(broker, "POST", "/rollout/scale_out", {"num_replicas": 4})
    assert r.status_code == 409 and rid in r.json()["error"]
    assert call(broker, "POST", "/rollout/scale_in", {"num_replicas": 1}).status_code == 409
    # the launcher starts the engines (internal route), the trainer syncs them (ZMQ)
    for status, body in (("CREATING", {"urls": [B, C]}), ("HEALTH_CHECKING", {}),
                         ("WEIGHT_SYNCING", {})):
        r = call(broker, "POST", f"/rollout/ops/{rid}/step", {"status": status, **body})
        assert r.status_code == 200 and r.json()["status"] == status, r.text
    assert call(broker, "POST", f"/rollout/ops/{rid}/step",
                {"status": "CREATING"}).status_code == 409
    with broker.client() as trainer:
        seen = trainer.engines()
        assert seen["cohort"] == [A, B, C] and seen["routable"] == [A]
        seen = trainer.engines(synced=[A, B, C])
    assert seen["routable"] == [A, B, C] and seen["current_op"] is None
    op = call(broker, "GET", f"/rollout/scale_out/{rid}").json()
    assert op["status"] == "ACTIVE" and op["history"][-1] == "ACTIVE"
    # scale-in: protected initial engines, dry run, drain, detach, stop
    r = call(broker, "POST", "/rollout/scale_in", {"engine_urls": [A]})
    assert r.status_code == 409 and "protected" in r.json()["error"]
    r = call(broker, "POST", "/rollout/scale_in", {"num_replicas": 1, "dry_run": True})
    assert r.status_code == 200 and r.json()["remove"] == [B, C]
    r = call(broker, "POST", "/rollout/scale_in", {"num_replicas": 2})
    assert r.status_code == 202 and r.json()["remove"] == [C]
    sid = r.json()["request_id"]
    with broker.client() as worker:
        assert worker.engines()["routable"] == [A, B]
        assert worker.engines(drained=[C])["cohort"] == [A, B]
        worker.engines(synced=[A, B])
    r = call(broker, "POST", "/rollout/engines/stopped", {"url": C})
    assert [e["url"] for e in r.json()["engines"]] == [A, B]
    assert call(broker, "GET", f"/rollout/scale_in/{sid}").json()["status"] == "COMPLETED"
    # cancel rolls back (engines that never got weights are stopped at once)
    rid = call(broker, "POST", "/rollout/scale_out", {"num_replicas": 3}).json()["request_id"]
    call(broker, "POST", f"/rollout/ops/{rid}/step", {"status": "CREATING", "urls": [C]})
    r = call(broker, "POST", f"/rollout/scale_out/{rid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    detached = [e["url"] for e in call(broker, "GET", "/rollout/engines").json()["engines"]
                if e["state"] == "detached"]
    assert detached == [C]
    # /status carries the engine list too; the broker is still up
    st = call(broker, "GET", "/status").json()
    assert st["engines"]["membership"] > 0 and broker.proc.poll() is None


def test_relax_ctl(broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from relax_slurm.launch.ctl import main
    from tests.unit.launch.test_health import ctl_run_dir

    run = ctl_run_dir(broker, tmp_path)

    def ctl(*argv: str) -> tuple[int, dict | str]:
        rc = main([argv[0], str(run), *argv[1:]])
        out = capsys.readouterr()
        return rc, (json.loads(out.out) if rc == 0 else out.err)

    rc, view = ctl("engines")
    assert rc == 0 and view["routable"] == [A]
    assert ctl("scale-out", "--num-replicas", "1")[1]["noop"] is True
    rc, err = ctl("scale-out")
    assert rc == 1 and "exactly one of" in err
    rc, got = ctl("scale-out", "--engine-url", B, "--timeout-secs", "30")
    assert rc == 0 and got["status"] == "PENDING"
    rc, err = ctl("scale-in", "--num-replicas", "1")
    assert rc == 1 and "HTTP 409" in err
    assert ctl("op-status", got["request_id"])[1]["mode"] == "external"
    assert ctl("cancel", got["request_id"])[1]["status"] == "CANCELLED"
    rc, got = ctl("scale-in", "--engine-url", A, "--dry-run")
    assert rc == 1 and "protected" in got


def test_listing_with_filters_and_cancelling_several(broker: Broker, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    """Relax's list and cancel-all routes over HTTP, and relax-ctl ops / cancel / cancel-all."""
    import json

    from relax_slurm.launch.ctl import main
    from tests.unit.launch.test_health import ctl_run_dir

    run = ctl_run_dir(broker, tmp_path)

    def ctl(*argv: str) -> tuple[int, dict | str]:
        rc = main([argv[0], str(run), *argv[1:]])
        out = capsys.readouterr()
        return rc, (json.loads(out.out) if rc == 0 else out.err)

    first = call(broker, "POST", "/rollout/scale_out", {"engine_urls": [B]}).json()["request_id"]
    assert ctl("cancel", first)[1]["status"] == "CANCELLED"
    second = call(broker, "POST", "/rollout/scale_out", {"engine_urls": [C]}).json()["request_id"]
    r = call(broker, "GET", "/rollout/scale_out?status=PENDING")
    assert r.status_code == 200 and [x["request_id"] for x in r.json()["requests"]] == [second]
    assert call(broker, "GET", "/rollout/scale_out").json()["total_count"] == 2
    assert call(broker, "GET", "/rollout/scale_out?model_name=critic").json()["total_count"] == 0
    assert call(broker, "GET", "/rollout/scale_out?status=BOGUS").status_code == 400
    assert call(broker, "GET", "/rollout/scale_in").json()["requests"] == []
    rc, listed = ctl("ops", "--status", "CANCELLED")
    assert rc == 0 and [x["request_id"] for x in listed["requests"]] == [first]
    rc, preview = ctl("cancel-all", "--dry-run")
    assert rc == 0 and preview["succeeded"] == [second] and preview["skipped"][0]["request_id"] \
        == first
    assert call(broker, "GET", f"/rollout/scale_out/{second}").json()["status"] == "PENDING"
    r = call(broker, "POST", "/rollout/scale_out_cancel", {"status_filter": "PENDING"})
    assert r.status_code == 200 and r.json()["succeeded"] == [second]
    assert call(broker, "GET", "/rollout/engines").json()["current_op"] is None
    rc, replies = ctl("cancel", first, second)  # several ids: one reply each (ended: no-ops)
    assert rc == 0 and [x["noop"] for x in replies["replies"]] == [True, True]


def test_a_broker_restarted_in_place_keeps_the_engine_list(
        start_broker: Callable[..., Broker], tmp_path: Path) -> None:
    save_plan(RunPlan(broker_router="tcp://x:1", broker_pub="tcp://x:2", engine_urls=[A]),
              tmp_path)
    spill = ("--spill", str(tmp_path / "broker" / "spill.bin"))
    first = start_broker(admin=True, extra_args=spill)
    rid = call(first, "POST", "/rollout/scale_out", {"num_replicas": 2}).json()["request_id"]
    call(first, "POST", f"/rollout/ops/{rid}/step", {"status": "CREATING", "urls": [B]})
    first.proc.kill()
    first.proc.wait(10)
    again = start_broker(admin=True, extra_args=(*spill, "--replay"))
    view = call(again, "GET", "/rollout/engines").json()
    assert [e["url"] for e in view["engines"]] == [A, B] and view["current_op"] == rid
    assert call(again, "POST", f"/rollout/ops/{rid}/step",
                {"status": "HEALTH_CHECKING"}).status_code == 200
    # a fresh start (no --replay) begins from the launch's engines again
    again.proc.kill()
    again.proc.wait(10)
    fresh = start_broker(admin=True, extra_args=spill)
    assert [e["url"] for e in call(fresh, "GET", "/rollout/engines").json()["engines"]] == [A]


def test_the_launcher_reports_an_engine_lost(broker: Broker) -> None:
    rid = call(broker, "POST", "/rollout/scale_out", {"engine_urls": [B]}).json()["request_id"]
    for status in ("CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING"):
        call(broker, "POST", f"/rollout/ops/{rid}/step", {"status": status})
    with broker.client() as trainer:
        trainer.engines(synced=[A, B])
    assert call(broker, "POST", "/rollout/engines/lost", {"url": B},
                token=None).status_code == 401
    r = call(broker, "POST", "/rollout/engines/lost", {"url": B, "why": "its Slurm job ended"})
    assert r.status_code == 200
    view = r.json()
    assert view["routable"] == [A] and view["cohort"] == [A]
    [gone] = [e for e in view["engines"] if e["url"] == B]
    assert gone["state"] == "detached" and gone["lost"] == "its Slurm job ended"
    # one not in service: nothing changes, no error (the launcher may report twice)
    again = call(broker, "POST", "/rollout/engines/lost", {"url": "http://nowhere:1"})
    assert again.status_code == 200 and again.json()["membership"] == view["membership"]
