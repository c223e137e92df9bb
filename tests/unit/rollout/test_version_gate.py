"""An engine behind the broker's floor gets no requests until it serves current weights
(rollout/version_gate.py): a restarted engine (version 0) made ~13,000 samples the broker
dropped before its re-sync."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.router import LeastLoadedRouter
from relax_slurm.rollout.version_gate import VersionGate


@dataclass
class Engine:
    url: str


def result(version: str, spans: list[tuple[str, int, int]] = ()) -> GenerateResult:
    return GenerateResult(output_ids=[1, 2], logprobs=[-1.0, -1.0], finish_reason="stop",
                          weight_version=version, weight_versions=list(spans))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gate_with(served: dict[str, str], floor: list[int | None], clock: Clock) -> VersionGate:
    asked: list[str] = []

    async def served_version(url: str) -> str | None:
        asked.append(url)
        return served[url]

    gate = VersionGate(lambda: floor[0], served_version, clock)
    gate.asked = asked
    return gate


def test_an_engine_older_than_the_floor_is_behind_until_it_serves_the_floor():
    served, floor, clock = {"a": "0", "b": "9"}, [None], Clock()
    gate = gate_with(served, floor, clock)
    gate.check("a", [result("0")])  # no floor heard yet: nothing to judge by
    assert gate.allows("a")
    floor[0] = 8  # the broker: version 9, max_staleness 1
    gate.check("b", [result("9"), result("8")])
    gate.check("a", [result("9"), result("0")])  # its oldest token judges it
    assert not gate.allows("a") and gate.allows("b") and gate.gated == 1
    # mixed spans (a pause mid-sequence): the oldest span counts
    gate.check("b", [result("9", [("7", 0, 1), ("9", 1, 2)])])
    assert not gate.allows("b")

    async def go() -> None:
        await gate.refresh()  # a: still 0; b: 9 >= 8
        assert not gate.allows("a") and gate.allows("b")
        clock.t += 0.1
        served["a"] = "9"
        await gate.refresh()  # asked at most every RECHECK_S
        assert not gate.allows("a") and gate.asked == ["a", "b"]
        clock.t += 1.0
        await gate.refresh()
        assert gate.allows("a") and gate.asked == ["a", "b", "a"]
    asyncio.run(go())


def test_the_router_skips_behind_engines_and_waits_when_every_one_is():
    served, floor, clock = {"a": "0", "b": "5"}, [5], Clock()
    gate = gate_with(served, floor, clock)
    router = LeastLoadedRouter([Engine("a"), Engine("b")], gate)
    gate.check("a", [result("0")])

    async def go() -> None:
        for _ in range(3):  # b only, although a has fewer requests in flight
            async with router.pick() as engine:
                assert engine.url == "b"
        served["b"] = "3"
        gate.check("b", [result("3")])  # now both are behind: a pick waits ...
        pick = asyncio.create_task(router.pick().__aenter__())
        await asyncio.sleep(0.3)
        assert not pick.done()
        served["a"] = "5"  # ... until one serves the floor again (re-synced)
        clock.t += 1.0
        engine = await asyncio.wait_for(pick, 30)
        assert engine.url == "a"
    asyncio.run(go())


def test_a_behind_engine_that_does_not_answer_holds_up_no_pick():
    """The behind engine's /model_info never answers (frozen): picks of the other engine go on
    (the refresh runs in the background), and the behind one stays behind."""
    never = asyncio.Event()

    async def served_version(url: str) -> str | None:
        await never.wait()  # never set: a frozen engine
        return "5"

    gate = VersionGate(lambda: 5, served_version)
    router = LeastLoadedRouter([Engine("a"), Engine("b")], gate)
    gate.check("a", [result("0")])

    async def go() -> None:
        for _ in range(3):
            engine = await asyncio.wait_for(router.pick().__aenter__(), 30)
            assert engine.url == "b"
        assert not gate.allows("a")
        gate._background.cancel()
    asyncio.run(go())
