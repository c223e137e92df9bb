"""The broker's operations and roles in process, without sockets: what each request answers,
what it parks and when a parked request is answered (the loop's side: tests/unit/broker/
test_server.py, a real broker process)."""

from __future__ import annotations

import time

import pytest

from relax_slurm.broker.elastic import Elastic
from relax_slurm.broker.elastic_routes import ElasticRoutes
from relax_slurm.broker.ops import Operations
from relax_slurm.broker.roles import MAX_ROLES, Roles, holder_of
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.stats import BatchStats, BrokerStats
from relax_slurm.errors import BrokerError
from tests.helpers_broker import group

W1, W2, T = b"rollout0:aa", b"rollout0:bb", b"trainer:cc"


class Loop:
    """What the server hands the operations: replies, broadcasts and a stop are recorded."""

    def __init__(self, state: BrokerState) -> None:
        self.replies: list[tuple[bytes, object, dict, object, str]] = []
        self.published: list[tuple[str, dict]] = []
        self.stopped = False
        self.ops = Operations(state, ElasticRoutes(Elastic([]), None, print),
                              reply=self.reply, publish=self.publish, stop=self.stop,
                              auth_refused=lambda: 5, log=lambda line: None)

    def reply(self, identity, rid, fields, groups=None, op="ok"):
        self.replies.append((identity, rid, fields, groups, op))

    def publish(self, topic, fields):
        self.published.append((topic, fields))

    def stop(self):
        self.stopped = True

    def call(self, op: str, identity: bytes, rid: int, groups=None, **fields):
        self.ops.table[op](identity, rid, fields, groups)


def test_a_parked_get_batch_is_answered_by_the_put_that_fills_it_then_acquires_wake():
    loop = Loop(BrokerState(max_staleness=0, batch_size=1))
    loop.call("acquire", W1, 1, max_n=1, wait_s=0)
    assert loop.replies[-1][2] == {"granted": 1, "floor": 0}  # the oldest version accepted
    loop.call("acquire", W1, 2, max_n=1, wait_s=30)  # no credit left: parked
    loop.call("get_batch", T, 3, num_groups=1, version=0, wait_s=30)
    assert len(loop.replies) == 1 and loop.ops.holds(T, 3) and loop.ops.holds(W1, 2)
    loop.call("put_group", W1, 4, groups=[group(0)])
    assert [(r[0], r[1]) for r in loop.replies[1:]] == [(W1, 4), (T, 3)]
    assert loop.replies[1][2] == {"floor": 0}
    stats = BatchStats.from_dict(loop.replies[-1][2]["stats"])
    assert stats.auth_refused == 5 and stats.counters.consumed == 1
    assert len(loop.replies[-1][3]) == 1
    loop.call("set_version", T, 5, version=1)  # a new credit: the parked acquire gets it
    assert loop.published == [("version", {"version": 1})]
    # set_version answers, then wakes the acquire
    assert [r[:3] for r in loop.replies[-2:]] == [(T, 5, {"version": 1}),
                                                    (W1, 2, {"granted": 1, "floor": 1})]
    assert not loop.ops.deadlines()


def test_parked_requests_expire_at_their_deadline_and_are_refused_at_the_end():
    loop = Loop(BrokerState(max_staleness=0, batch_size=1, open_admission=False))
    loop.call("acquire", W1, 1, max_n=1, wait_s=30)
    loop.call("get_batch", T, 2, num_groups=1, version=0, wait_s=0.5)
    [deadline_acquire, deadline_batch] = loop.ops.deadlines()
    loop.ops.expire(deadline_batch)  # the batch's deadline only
    (identity, rid, fields, _, op) = loop.replies[-1]
    assert (identity, rid, op, fields["timeout"]) == (T, 2, "ok", True)
    # (start + 0.5) - start: one subtraction's rounding at the clock's magnitude (~1e-12 s)
    assert fields["wait_s"] == pytest.approx(0.5, abs=1e-9)
    loop.ops.refuse_parked("broker is shutting down")
    assert loop.replies[-1][1:] == (1, {"error": "broker is shutting down", "shutdown": True},
                                    None, "error")
    assert not loop.ops.deadlines() and deadline_acquire > deadline_batch


def test_a_rejoin_retires_the_predecessor_and_takes_back_its_credits():
    loop = Loop(BrokerState(max_staleness=1, batch_size=1))
    loop.call("acquire", W1, 1, max_n=2, wait_s=0)
    loop.call("rejoin", W2, 2, rank=0)
    assert loop.replies[-1][2] == {"reclaimed": 2, "position": None}
    with pytest.raises(BrokerError, match="a restarted one replaced"):
        loop.call("put_group", W1, 3, groups=[group(0)])
    loop.call("stats", T, 4)
    stats = BrokerStats.from_dict(loop.replies[-1][2])
    assert stats.counters.in_flight == 0 and stats.auth_refused == 5


def test_status_and_shutdown():
    loop = Loop(BrokerState(max_staleness=0, batch_size=1))
    loop.call("heartbeat", T, 1, role="trainer", info={"step": 3})
    now = time.monotonic()
    status = loop.ops.status(now, now - 2.0)
    # now - (now - 2.0): the rounding of one subtraction at the clock's magnitude (~1e-12 s)
    assert status.uptime_s == pytest.approx(2.0, abs=1e-9) and status.roles["trainer"]["step"] == 3
    assert 0 <= status.roles["trainer"]["heartbeat_age_s"] <= time.monotonic() - now
    loop.call("shutdown", T, 2)
    assert loop.stopped and loop.published == [("shutdown", {})]


def test_roles_bound_what_a_client_can_add_and_name_what_is_wrong():
    roles = Roles()
    assert holder_of(W1) == holder_of(W2) == "rollout0" == roles.seen(W1)
    roles.seen(W2)
    assert roles.rejoin(W2) == "rollout0" and roles.retired(W1) and not roles.retired(W2)
    for bad, match in ((("", {}), "non-empty role"), (("x" * 129, {}), "non-empty role"),
                       (("r", {str(i): i for i in range(33)}), "at most 32 entries"),
                       (("r", [1]), "at most 32 entries")):
        with pytest.raises(BrokerError, match=match):
            roles.beat(*bad, now=0.0)
    for i in range(MAX_ROLES):
        roles.beat(f"r{i}", None, now=float(i))
    roles.beat("r0", {"step": 1}, now=10.0)  # a known role still beats
    with pytest.raises(BrokerError, match=f"more than {MAX_ROLES} roles"):
        roles.beat("one-more", {}, now=0.0)
    assert roles.ages(now=20.0)["r0"] == 10.0 and roles.view(now=20.0)["r0"]["step"] == 1
