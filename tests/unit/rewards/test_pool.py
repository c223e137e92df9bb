"""RewardPool: real worker processes, timeouts, crashes, the concurrency cap, clean shutdown."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
import types

import pytest

from relax_slurm.config.schema import RewardConfig
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
        RewardPool(0, timeout_s=1.0)
