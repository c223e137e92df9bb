"""The broker's reports as types (broker/stats.py): what the broker sends is what its readers
(the trainer, the launcher's hang watch, summary.json) read, key for key."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.flat import FLAT, flat_fields, from_flat, to_flat
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
                     counters=counters(), auth_refused=1, wait_s=0.25)
    assert BatchStats.from_dict(got.to_dict()) == got
    # the counters stand beside the staleness on the wire, as in the `stats` answer
    assert list(got.to_dict()) == [
        "staleness_max", "staleness_mean", "staleness_hist", "version", "accepted", "dropped",
        "consumed", "in_flight", "released", "queue_depth", "auth_refused", "wait_s"]
    # what the server and the client add is optional: the state machine's own take reads
    bare = {k: v for k, v in got.to_dict().items() if k not in ("auth_refused", "wait_s")}
    assert BatchStats.from_dict(bare) == dataclasses.replace(got, auth_refused=0, wait_s=0.0)
    del bare["consumed"]
    with pytest.raises(BrokerError, match=r"get_batch's stats: missing key\(s\) \['consumed'\]"):
        BatchStats.from_dict(bare)
    with pytest.raises(BrokerError, match=r"unknown key\(s\) \['stalenes_max'\]"):
        BatchStats.from_dict({**got.to_dict(), "stalenes_max": 2})
    # the name of before: the trainer logs counters.dropped as broker/dropped_stale
    with pytest.raises(BrokerError, match=r"unknown key\(s\) \['dropped_stale'\]"):
        BatchStats.from_dict({**got.to_dict(), "dropped_stale": 0})


def test_no_batch_is_every_number_zero() -> None:
    assert BatchStats.merge([]) == BatchStats.empty()
    assert all(v in (0, {}) for v in BatchStats.empty().to_dict().values())
    assert BatchStats.from_dict(BatchStats.empty().to_dict()) == BatchStats.empty()


# ---- the helper every report uses (broker/flat.py) -------------------------------------------

@dataclass(kw_only=True)
class Inner:
    a: int
    b: int = 0


@dataclass(kw_only=True)
class Outer:
    x: int
    inner: Inner = field(metadata=FLAT)
    boxed: Inner
    y: dict[str, int] = field(default_factory=dict)


def test_flat_fields_expand_a_flat_field_in_place_and_say_which_keys_are_required() -> None:
    assert flat_fields(Outer) == {"x": True, "a": True, "b": False, "boxed": True, "y": False}
    assert flat_fields(Counters) == dict.fromkeys(
        ["version", "accepted", "dropped", "consumed", "in_flight", "released", "queue_depth"],
        True)


def test_to_flat_and_from_flat_are_inverse_and_copy_plain_values() -> None:
    obj = Outer(x=1, inner=Inner(a=2, b=3), boxed=Inner(a=4), y={"k": 5})
    d = to_flat(obj)
    assert d == {"x": 1, "a": 2, "b": 3, "boxed": {"a": 4, "b": 0}, "y": {"k": 5}}
    assert d["y"] is not obj.y  # (as asdict: the map sent is not the object's own)
    assert from_flat(Outer, d, "here") == obj
    # defaults fill what a map leaves out, in a flat field too
    assert from_flat(Outer, {"x": 1, "a": 2, "boxed": {"a": 4}}, "here") == Outer(
        x=1, inner=Inner(a=2), boxed=Inner(a=4))


def test_from_flat_names_the_key_and_the_type() -> None:
    good = {"x": 1, "a": 2, "boxed": {"a": 4}}
    with pytest.raises(BrokerError, match=r"here: missing key\(s\) \['a'\] of Outer"):
        from_flat(Outer, {"x": 1, "boxed": {"a": 4}}, "here")
    with pytest.raises(BrokerError, match=r"here boxed: missing key\(s\) \['a'\] of Inner"):
        from_flat(Outer, {**good, "boxed": {}}, "here")
    with pytest.raises(BrokerError, match=r"here boxed: unknown key\(s\) \['c'\]; Inner has"):
        from_flat(Outer, {**good, "boxed": {"a": 4, "c": 0}}, "here")
    with pytest.raises(BrokerError, match=r"here: unknown key\(s\) \['z'\]; Outer has"):
        from_flat(Outer, {**good, "z": 0}, "here")
    with pytest.raises(BrokerError, match="here boxed: expected a map, got int"):
        from_flat(Outer, {**good, "boxed": 4}, "here")
    # derived keys: required, checked, not read
    assert from_flat(Outer, {**good, "top": 9}, "here", derived=("top",)) == from_flat(
        Outer, good, "here")
    with pytest.raises(BrokerError, match=r"missing key\(s\) \['top'\] of Outer"):
        from_flat(Outer, good, "here", derived=("top",))
