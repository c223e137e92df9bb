"""The broker's reports as types (broker/stats.py): what the broker sends is what its readers
(the trainer, the launcher's hang watch, summary.json) read, key for key."""

from __future__ import annotations

import json

import pytest

from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.stats import BatchStats, BrokerStats, BrokerStatus, Counters
from relax_slurm.errors import BrokerError


def counters() -> Counters:
    return Counters(**BrokerState(max_staleness=1, batch_size=2).counters())


def stats() -> BrokerStats:
    return BrokerStats(counters=counters(), max_staleness=1, batch_size=2, parked_acquires=0,
                       parked_get_batch=1, auth_refused=3, heartbeat_age_s={"trainer": 0.5})


def status() -> BrokerStatus:
    return BrokerStatus(counters=counters(), max_staleness=1, batch_size=2, admission_open=True,
                        parked_acquires=0, parked_get_batch=0, auth_refused=0, uptime_s=1.5,
                        pid=123, engines={"version": 1, "engines": []},
                        roles={"trainer": {"heartbeat_age_s": 2.0, "step": 3}})


def test_round_trips() -> None:
    assert BrokerStats.from_dict(stats().to_dict()) == stats()
    assert stats().counters == counters()
    # /status travels as JSON
    assert BrokerStatus.from_dict(json.loads(json.dumps(status().to_dict()))) == status()
    assert status().heartbeat_ages() == {"trainer": 2.0}


def test_the_json_is_the_flat_map_readers_scrape() -> None:
    """The counters are one type nested in both reports; their JSON keeps its keys of before:
    `stats` flat, /status with three counters repeated at its top level."""
    assert list(stats().to_dict()) == [
        "version", "accepted", "dropped", "consumed", "in_flight", "released", "queue_depth",
        "max_staleness", "batch_size", "parked_acquires", "parked_get_batch", "auth_refused",
        "heartbeat_age_s"]
    d = status().to_dict()
    assert list(d) == ["version", "queue_depth", "in_flight", "counters", "max_staleness",
                       "batch_size", "admission_open", "parked_acquires", "parked_get_batch",
                       "auth_refused", "uptime_s", "pid", "engines", "roles"]
    assert (d["version"], d["counters"]["accepted"]) == (0, 0)
    assert stats().to_dict()["released"] == stats().counters.released
    del d["queue_depth"]
    with pytest.raises(BrokerError, match=r"missing key\(s\) \['queue_depth'\] of BrokerStatus"):
        BrokerStatus.from_dict(d)


def test_the_state_machine_counts_what_the_counters_type_has() -> None:
    assert set(counters().to_dict()) == set(BrokerState(0, 1).counters())


def test_an_unknown_key_is_named() -> None:
    with pytest.raises(BrokerError, match=r"the broker's stats: unknown key\(s\) \['acepted'\]"):
        BrokerStats.from_dict({**stats().to_dict(), "acepted": 1})


def test_a_missing_key_is_named() -> None:
    d = stats().to_dict()
    del d["released"]
    with pytest.raises(BrokerError, match=r"missing key\(s\) \['released'\] of BrokerStats"):
        BrokerStats.from_dict(d)
    d = status().to_dict()
    del d["counters"]["consumed"]
    with pytest.raises(BrokerError, match=r"/status counters: missing key\(s\) \['consumed'\]"):
        BrokerStatus.from_dict(d)
    with pytest.raises(BrokerError, match="expected a map"):
        BrokerStatus.from_dict(["not", "a", "map"])


def test_batch_stats_round_trip_and_name_a_missing_key() -> None:
    got = BatchStats(staleness_max=2, staleness_mean=1.5, staleness_hist={1: 2, 2: 2},
                     queue_depth=3, dropped_stale=1, accepted=9, consumed=4, in_flight=2,
                     auth_refused=1, wait_s=0.25)
    assert BatchStats.from_dict(got.to_dict()) == got
    # a reply recorded before the client added wait_s (a spill file's answer) still reads
    old = {k: v for k, v in got.to_dict().items() if k != "wait_s"}
    assert BatchStats.from_dict(old).wait_s == 0.0
    del old["consumed"]
    with pytest.raises(BrokerError, match=r"get_batch's stats: missing key\(s\) \['consumed'\]"):
        BatchStats.from_dict(old)
    with pytest.raises(BrokerError, match=r"unknown key\(s\) \['stalenes_max'\]"):
        BatchStats.from_dict({**got.to_dict(), "stalenes_max": 2})
