"""RewardPool: real worker processes, timeouts, crashes, the concurrency cap, clean shutdown."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
import types

import pytest

from relax_slurm.config.reward import RewardConfig
from relax_slurm.errors import ConfigError
from relax_slurm.rewards import RewardInput, RewardPool, build_reward

# Rewards the workers import by module name: written to a temporary module on sys.path (spawned
# workers get the parent's sys.path).
HELPERS = textwrap.dedent("""
    import os
    import time

    def pid(inp):
        return float(os.getpid())

    def hang(inp):
        while True:  # pure-Python busy loop: no thread could stop this
            pass

    def boom(inp):
        raise RuntimeError("boom")

    def text(inp):
        return "high"

    def crash(inp):
        os._exit(3)

    def sleepy(inp):
        time.sleep(0.5)
        return float(os.getpid())

    def item(inp):  # score_many: a number scores itself; a word says how to fail
        if inp == "hang":
            while True:
                pass
        if inp == "boom":
            raise RuntimeError("boom")
        if inp == "crash":
            os._exit(3)
        if inp == "nap":
            time.sleep(0.1)
            return -1.0
        return float(inp)

    def pid_of(inp):
        return float(os.getpid())

    def nap_pid(inp):
        time.sleep(0.5)
        return float(os.getpid())
""")

INP = RewardInput(prompt="", response="7", label="7")


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    name = f"pool_helpers_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


def run(coro):
    return asyncio.run(coro)


def test_scores_errors_and_reuses_its_worker(helpers):
    async def main():
        async with RewardPool(1, timeout_s=10.0, warm_up=False) as pool:
            assert await pool.score("exact_match", INP) == (1.0, False)
            pid, error = await pool.score(helpers.pid, INP)
            assert not error
            assert await pool.score(helpers.boom, INP) == (0.0, True)
            assert await pool.score(helpers.text, INP) == (0.0, True)  # not a number
            assert await pool.score(helpers.pid, INP) == (pid, False)  # same process
            assert (pool.calls, pool.errors) == (5, 2)
            # a worker that dropped a reward from its cache asks for it again
            worker = pool._idle[0]
            worker.known.add(pool._key(helpers.sleepy))
            assert await pool.score(helpers.sleepy, INP) == (pid, False)
            workers = list(pool._all)
        assert len(workers) == 1 and not workers[0].proc.is_alive()  # closed on exit

    run(main())


def test_a_hanging_reward_is_killed_and_the_loop_keeps_running(helpers):
    async def main():
        async def nap():
            await asyncio.sleep(0.05)
            return time.perf_counter()

        async with RewardPool(1, timeout_s=1.0, warm_up=False) as pool:
            await pool.start()
            first = next(iter(pool._all))
            start = time.perf_counter()
            nap_task = asyncio.create_task(nap())
            assert await pool.score(helpers.hang, INP) == (0.0, True)
            returned = time.perf_counter()
            assert 1.0 <= returned - start < 5.0
            assert await nap_task < returned  # the event loop ran while the reward spun
            assert not first.proc.is_alive()
            # a fresh worker takes over
            assert await pool.score("exact_match", INP) == (1.0, False)
            assert pool.errors == 1

    run(main())


def test_a_crashing_worker_is_replaced(helpers):
    async def main():
        async with RewardPool(1, timeout_s=10.0, warm_up=False) as pool:
            assert await pool.score(helpers.crash, INP) == (0.0, True)
            assert await pool.score("exact_match", INP) == (1.0, False)

    run(main())


def test_concurrency_is_capped(helpers):
    async def main():
        async with RewardPool(2, timeout_s=10.0, warm_up=False) as pool:
            await pool.start()
            start = time.perf_counter()
            results = await asyncio.gather(*[pool.score(helpers.sleepy, INP) for _ in range(4)])
            elapsed = time.perf_counter() - start
            assert all(not error for _, error in results)
            assert len({pid for pid, _ in results}) == 2  # two workers, reused
            assert elapsed >= 1.0  # 4 calls of 0.5 s, two at a time

    run(main())


def test_rewards_that_cannot_reach_a_worker_fail_loudly(helpers):
    ghost = types.ModuleType("ghost_module_not_on_path")
    exec("def reward(inp):\n    return 1.0\n", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost  # picklable here, not importable in a worker

    async def main():
        async with RewardPool(1, timeout_s=10.0, warm_up=False) as pool:
            with pytest.raises(ConfigError, match="module-level"):
                await pool.score(lambda inp: 1.0, INP)
            with pytest.raises(ConfigError, match="cannot load"):
                await pool.score(ghost.reward, INP)
            with pytest.raises(ConfigError, match="remote_url"):
                await pool.score("remote", INP)  # a config problem, not a sample's
            assert await pool.score("exact_match", INP) == (1.0, False)

    try:
        run(main())
    finally:
        sys.modules.pop(ghost.__name__, None)


def test_score_many_keeps_order_and_splits_across_workers(helpers):
    async def main():
        async with RewardPool(2, timeout_s=10.0, warm_up=False) as pool:
            assert await pool.score_many(helpers.item, []) == []
            assert await pool.score_many(helpers.item, list(range(7))) == [
                (float(i), False) for i in range(7)]
            pids = [pid for pid, _ in await pool.score_many(helpers.pid_of, list(range(6)))]
            assert pids[:3] == [pids[0]] * 3 and pids[3:] == [pids[3]] * 3  # contiguous chunks
            assert pids[0] != pids[3]
            assert await pool.score_many("exact_match", [INP, INP]) == [(1.0, False)] * 2
            assert (pool.calls, pool.errors) == (15, 0)

    run(main())


def test_a_fast_rewards_groups_stay_on_one_worker(helpers):
    """Splitting a group over workers pays for a slow reward only: once the pool has seen a
    reward take under split_above_s per input, its groups go to one worker in one message; a
    slow one's keep splitting. (0.2 s: far above a round trip of pid_of even on a loaded
    machine, far below nap_pid's 0.5 s sleep, which can only overrun.)"""
    async def main():
        async with RewardPool(2, timeout_s=10.0, warm_up=False, split_above_s=0.2) as pool:
            await pool.start()
            # both workers import the helpers' module first (another reward: its own estimate),
            # so pid_of's first estimate is its round trip, not an import on a loaded machine
            await pool.score_many(helpers.item, [0, 1])
            first = [p for p, _ in await pool.score_many(helpers.pid_of, list(range(6)))]
            assert len(set(first)) == 2  # nothing known yet: split
            again = [p for p, _ in await pool.score_many(helpers.pid_of, list(range(6)))]
            assert len(set(again)) == 1
            for _ in range(2):  # 0.5 s per input: always split
                naps = await pool.score_many(helpers.nap_pid, list(range(4)))
                assert len({p for p, _ in naps}) == 2

    run(main())


def test_score_many_times_each_input_not_the_group(helpers):
    async def main():
        async with RewardPool(1, timeout_s=1.5, warm_up=False) as pool:
            await pool.start()
            # 0.1 s inputs, 2 s in all: over the timeout, each well within it (even on a busy
            # machine, where a sleep may overrun several-fold)
            start = time.perf_counter()
            assert await pool.score_many(helpers.item, ["nap"] * 20) == [(-1.0, False)] * 20
            assert time.perf_counter() - start >= 2.0
            first = next(iter(pool._all))
            start = time.perf_counter()
            scored = await pool.score_many(helpers.item, [1, "hang", 3, 4])
            elapsed = time.perf_counter() - start
            assert scored == [(1.0, False), (0.0, True), (3.0, False), (4.0, False)]
            assert 1.5 <= elapsed < 6.0  # one timeout, then the rest in a fresh worker
            assert not first.proc.is_alive() and len(pool._all) == 1
            assert (pool.calls, pool.errors) == (24, 1)

    run(main())


def test_score_many_errors_only_the_failing_inputs(helpers):
    async def main():
        async with RewardPool(1, timeout_s=10.0, warm_up=False) as pool:
            await pool.start()
            worker = next(iter(pool._all))
            assert await pool.score_many(helpers.item, [1, "boom", 3, 1e999]) == [
                (1.0, False), (0.0, True), (3.0, False), (0.0, True)]  # raised; infinite
            assert pool._idle == [worker]  # a raising reward does not cost the worker
            assert await pool.score_many(helpers.item, [1, "crash", 3, "crash", 5]) == [
                (1.0, False), (0.0, True), (3.0, False), (0.0, True), (5.0, False)]
            assert not worker.proc.is_alive()
            assert (pool.calls, pool.errors) == (9, 4)

    run(main())


def test_score_many_raises_config_errors(helpers):
    async def main():
        async with RewardPool(2, timeout_s=10.0, warm_up=False) as pool:
            with pytest.raises(ConfigError, match="module-level"):
                await pool.score_many(lambda inp: 1.0, [INP] * 4)
            with pytest.raises(ConfigError, match="remote_url"):
                await pool.score_many("remote", [INP] * 3)
            assert await pool.score_many("exact_match", [INP] * 3) == [(1.0, False)] * 3

    run(main())


def test_math_with_rm_type_in_a_warmed_worker():
    async def main():
        async with RewardPool(1, timeout_s=5.0) as pool:
            scorer = build_reward(RewardConfig(name="exact_match"))
            inp = RewardInput(prompt="", response=r"so \boxed{\frac{1}{2}}", label="0.5",
                              metadata={"rm_type": "math"})
            assert await pool.score(scorer, inp) == (1.0, False)
            assert await pool.score(scorer, INP) == (1.0, False)

    run(main())


def test_bad_pool_settings_name_the_config_keys():
    with pytest.raises(ConfigError, match="reward.num_workers"):
        RewardPool(-1, timeout_s=1.0)


def test_no_workers_scores_in_this_process(helpers):
    import os

    async def main():
        async with RewardPool(0, timeout_s=1.0) as pool:
            assert await pool.score("exact_match", INP) == (1.0, False)
            assert await pool.score(helpers.pid, INP) == (float(os.getpid()), False)
            assert await pool.score_many(helpers.boom, [INP, INP]) == [(0.0, True)] * 2
            assert await pool.score(helpers.text, INP) == (0.0, True)  # not a number
            with pytest.raises(ConfigError, match="remote_url"):
                await pool.score_many("remote", [INP])
            assert await pool.score_many(lambda inp: 2.0, [INP]) == [(2.0, False)]  # unpicklable
            assert (pool.calls, pool.errors) == (7, 3) and not pool._all  # no process started

    run(main())
