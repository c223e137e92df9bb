"""The elastic rollout state machine (broker/elastic.py): pure, no processes."""

import pytest

from relax_slurm.broker.elastic import (ACTIVE, CANCELLED, COMPLETED, CREATING, DETACHING,
                                        DRAINING, FAILED, HEALTH_CHECKING, PENDING,
                                        WEIGHT_SYNCING, Elastic, OpRefused)

A, B, C = "http://h:1", "http://h:2", "http://h:3"


def out_to(el: Elastic, urls: list[str], now: float = 0.0) -> str:
    rid = el.scale_out({"num_replicas": 1 + len(urls)}, now)["request_id"]
    el.launcher_step(rid, CREATING, urls=urls)
    el.launcher_step(rid, HEALTH_CHECKING)
    el.launcher_step(rid, WEIGHT_SYNCING)
    return rid


def test_scale_out_walks_every_state_and_joins_after_sync():
    el = Elastic([A])
    r = el.scale_out({"num_replicas": 3, "timeout_secs": 60}, now=0.0)
    assert r["status"] == PENDING
    rid = r["request_id"]
    el.launcher_step(rid, CREATING, urls=[B, C])
    assert el.routable_urls() == [A] and el.cohort_urls() == [A]
    el.launcher_step(rid, HEALTH_CHECKING)
    el.launcher_step(rid, WEIGHT_SYNCING)
    assert el.cohort_urls() == [A, B, C] and el.routable_urls() == [A]
    el.synced([A, B, C])
    assert el.op(rid).status == ACTIVE and el.current is None
    assert el.op(rid).history == [PENDING, CREATING, HEALTH_CHECKING, WEIGHT_SYNCING, ACTIVE]
    assert el.routable_urls() == [A, B, C]


def test_one_at_a_time_and_noop_and_bad_input():
    el = Elastic([A, B])
    assert el.scale_out({"num_replicas": 2}, 0.0)["noop"] is True
    assert el.scale_out({"engine_urls": [B]}, 0.0)["noop"] is True
    el.scale_out({"num_replicas": 3}, 0.0)
    with pytest.raises(OpRefused) as e:
        el.scale_out({"num_replicas": 4}, 0.0)
    assert e.value.code == 409
    for bad in ({}, {"num_replicas": 0}, {"num_replicas": 2, "engine_urls": [C]},
                {"engine_urls": ["ftp://x"]}, {"num_replicas": True},
                {"num_replicas": 3, "timeout_secs": -1}):
        with pytest.raises(OpRefused) as e:
            Elastic([A]).scale_out(bad, 0.0)
        assert e.value.code == 400, bad
    with pytest.raises(OpRefused) as e:
        el.op("nope")
    assert e.value.code == 404


def test_launcher_cannot_skip_states():
    el = Elastic([A])
    rid = el.scale_out({"num_replicas": 2}, 0.0)["request_id"]
    with pytest.raises(OpRefused):
        el.launcher_step(rid, WEIGHT_SYNCING)
    with pytest.raises(OpRefused):
        el.launcher_step(rid, CREATING, urls=[B, C])  # one asked for


def test_cancel_and_timeout_roll_back():
    el = Elastic([A])
    rid = el.scale_out({"num_replicas": 2}, 0.0)["request_id"]
    el.launcher_step(rid, CREATING, urls=[B])
    assert el.cancel(rid)["status"] == CANCELLED
    assert [e.url for e in el.to_stop()] == [B]
    el.stopped(B)
    assert list(el.engines) == [A] and el.current is None
    assert el.cancel(rid)["noop"] is True
    # a timeout at WEIGHT_SYNCING: the engine leaves the cohort first, then is stopped
    rid = out_to(el, [C], now=10.0)
    el.expire(10.0 + 601)
    assert el.op(rid).status == FAILED and el.cohort_urls() == [A] and el.to_stop() == []
    el.synced([A])
    assert [e.url for e in el.to_stop()] == [C]


def test_scale_in_drains_then_detaches_and_protects_initial():
    el = Elastic([A], drain_timeout_s=30)
    rid = out_to(el, [B, C])
    el.synced([A, B, C])
    with pytest.raises(OpRefused) as e:
        el.scale_in({"engine_urls": [A]}, 0.0)
    assert e.value.code == 409
    with pytest.raises(OpRefused) as e:
        el.scale_in({"num_replicas": 0}, 0.0)
    assert e.value.code == 400
    dry = el.scale_in({"num_replicas": 1, "dry_run": True}, 0.0)
    assert dry["remove"] == [B, C] and el.current is None
    r = el.scale_in({"num_replicas": 2}, 0.0)
    assert r["remove"] == [C] and r["status"] == DRAINING
    assert el.routable_urls() == [A, B] and el.cohort_urls() == [A, B, C]
    el.drained(C)
    assert el.op(r["request_id"]).status == DETACHING and el.cohort_urls() == [A, B]
    el.synced([A, B])
    el.stopped(C)
    assert el.op(r["request_id"]).status == COMPLETED and el.current is None
    assert el.scale_in({"num_replicas": 2}, 0.0)["noop"] is True
    # the drain timeout detaches what is left; force does at once
    r = el.scale_in({"engine_urls": [B]}, 100.0)
    el.expire(131.0)
    assert el.op(r["request_id"]).status == DETACHING
    assert rid


def test_force_skips_the_drain():
    el = Elastic([A])
    out_to(el, [B])
    el.synced([A, B])
    r = el.scale_in({"num_replicas": 1, "force": True}, 0.0)
    assert r["status"] == DETACHING and el.cohort_urls() == [A]


def test_a_lost_engine_is_detached_at_once_and_leaves_when_stopped():
    el = Elastic([A])
    rid = out_to(el, [B, C])
    assert el.lost(B, "job ended") is False  # joining: its scale-out fails instead
    el.synced([A, B, C])
    before = el.membership
    assert el.lost(B + "/", "its Slurm job 7 ended") is True
    assert el.membership > before
    assert el.routable_urls() == [A, C] and el.cohort_urls() == [A, C]
    assert [(e.url, e.lost) for e in el.to_stop()] == [(B, "its Slurm job 7 ended")]
    assert el.lost(B, "again") is False and el.lost("http://h:9", "unknown") is False
    el.stopped(B)
    assert [e.url for e in el.serving()] == [A, C] and el.current is None
    assert el.op(rid).status == ACTIVE  # what added it is history
    # one lost while a scale-in drains it: counted drained, the scale-in completes
    r = el.scale_in({"num_replicas": 1}, 0.0)
    assert r["remove"] == [C]
    el.lost(C, "external server stopped answering")
    assert el.op(r["request_id"]).status == DETACHING
    el.stopped(C)
    assert el.op(r["request_id"]).status == COMPLETED and el.current is None
    # and it survives the broker's restart (state file)
    el.lost(A, "x")
    again = Elastic([])
    again.load(el.to_dict())
    assert again.engines[A].lost == "x"
