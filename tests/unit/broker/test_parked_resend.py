"""The broker's parked-request queues and resend cache, in process (no sockets)."""

from __future__ import annotations

from relax_slurm.broker.parked import ParkedQueue
from relax_slurm.broker.resend import AnswerCache


def test_parked_requests_leave_first_in_first_out_and_expire_by_deadline():
    q = ParkedQueue()
    q.park(b"a", 1, {"max_n": 1}, wait_s=100.0)
    q.park(b"b", 2, {"max_n": 2}, wait_s=0.0)
    q.park(b"c", 3, {"max_n": 3}, wait_s=100.0)
    assert len(q) == 3 and q.holds(b"b", 2) and not q.holds(b"b", 1)
    [due] = q.expired(now=q.first().start + 1.0)  # only b's deadline has passed
    assert (due.identity, due.rid) == (b"b", 2)
    assert [p.identity for p in q] == [b"a", b"c"]
    assert q.pop_first().identity == b"a" and q.first().identity == b"c"
    assert [p.rid for p in q.take_all()] == [3] and len(q) == 0 and q.first() is None


def test_answer_cache_keeps_the_latest_answers_of_the_latest_clients():
    cache = AnswerCache(per_client=2, clients=2)
    for rid in range(3):
        cache.remember(b"a", rid, [f"a{rid}"])
    assert cache.get(b"a", 0) is None and cache.get(b"a", 2) == ["a2"]
    cache.remember(b"b", 0, ["b0"])
    cache.remember(b"a", 3, ["a3"])  # a is the most recent client again
    cache.remember(b"c", 0, ["c0"])  # evicts b, the least recent
    assert cache.get(b"b", 0) is None
    assert cache.get(b"a", 3) == ["a3"] and cache.get(b"c", 0) == ["c0"]
