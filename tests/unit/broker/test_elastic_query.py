"""Listing scale operations with filters, and cancelling matching scale-outs at once
(broker/elastic_query.py): pure, on an Elastic state machine."""

import pytest

from relax_slurm.broker.elastic import (CANCELLED, CREATING, HEALTH_CHECKING, WEIGHT_SYNCING,
                                        Elastic, OpRefused)
from relax_slurm.broker.elastic_query import cancel_matching, list_ops

A, B, C = "http://h:1", "http://h:2", "http://h:3"


def active_then_pending() -> tuple[Elastic, str, str]:
    """One scale-out ended ACTIVE, one PENDING (one at a time: the second after the first)."""
    el = Elastic([A])
    done = el.scale_out({"num_replicas": 2}, 0.0)["request_id"]
    for status, urls in ((CREATING, [B]), (HEALTH_CHECKING, None), (WEIGHT_SYNCING, None)):
        el.launcher_step(done, status, urls=urls)
    el.synced([A, B])
    pending = el.scale_out({"num_replicas": 3}, 1.0)["request_id"]
    return el, done, pending


def test_list_filters_by_status_and_model_and_refuses_unknown_statuses():
    el, done, pending = active_then_pending()
    every = list_ops(el, "scale_out", {})
    assert [r["request_id"] for r in every["requests"]] == [done, pending]
    assert every["total_count"] == 2 and every["status_filter"] is None
    got = list_ops(el, "scale_out", {"status": "pending"})
    assert [r["request_id"] for r in got["requests"]] == [pending]
    assert got["status_filter"] == "PENDING" and got["requests"][0]["model_name"] == "default"
    assert list_ops(el, "scale_out", {"model_name": "default"})["total_count"] == 2
    assert list_ops(el, "scale_out", {"model_name": "critic"})["total_count"] == 0
    assert list_ops(el, "scale_in", {})["requests"] == []
    with pytest.raises(OpRefused) as e:
        list_ops(el, "scale_in", {"status": "ACTIVE"})
    assert e.value.code == 400 and "DRAINING" in str(e.value)


def test_cancel_matching_skips_ended_ones_and_dry_run_changes_nothing():
    el, done, pending = active_then_pending()
    preview = cancel_matching(el, {"dry_run": True})
    assert preview["succeeded"] == [pending] and preview["dry_run"] is True
    assert preview["skipped"] == [{"request_id": done, "status": "ACTIVE",
                                   "reason": "already ACTIVE"}]
    assert el.op(pending).status == "PENDING"
    got = cancel_matching(el, {"status_filter": "PENDING"})
    assert got["succeeded"] == [pending] and got["total_count"] == 1
    assert got["filters"] == {"model_name": None, "status_filter": "PENDING"}
    assert el.op(pending).status == CANCELLED and el.current is None
    assert cancel_matching(el, {})["succeeded"] == []  # nothing left under way
    for bad in ({"dry_run": "yes"}, {"status_filter": "DRAINING"}):
        with pytest.raises(OpRefused):
            cancel_matching(el, bad)
