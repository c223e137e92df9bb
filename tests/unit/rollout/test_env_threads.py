"""A blocking environment holds up its own episode, not the rollout worker's event loop
(rollout/multiturn.py `_env_call`). An environment whose plain `step` slept (a subprocess, an
HTTP request) stopped every other episode and the worker's heartbeats: a run with a 3-s step
showed the worker's heartbeat 12 s old and would have been restarted as hung. Plain methods of
`blocking` environments now run in the worker's `env.threads`; coroutines and the built-ins
(`blocking = False`) on the loop."""

from __future__ import annotations

import asyncio
import threading

from relax_slurm.data import load_tokenizer
from relax_slurm.engines.client import GenerateResult
from relax_slurm.envs import BaseEnv, StepResult
from relax_slurm.envs.arith_feedback import ArithFeedbackEnv
from relax_slurm.rollout.env_threads import EnvThreads
from relax_slurm.rollout.multiturn import ObservationRenderer, TurnLimits, run_episode

EOS = 1


async def generate(ids, params, routed_start):
    return GenerateResult(output_ids=[5, EOS], logprobs=[-0.1, -0.1], finish_reason="stop",
                          weight_version="0")


class Waits(BaseEnv):
    """A plain step that blocks until `gate` is set (by the event loop, in the test), or, with
    no gate, returns at once."""

    def __init__(self, gate: threading.Event | None) -> None:
        self.gate, self.threads = gate, []

    def reset(self, sample):
        self.threads.append(threading.get_ident())
        return None, {}

    def step(self, model_text: str) -> StepResult:
        self.threads.append(threading.get_ident())
        met = self.gate is None or self.gate.wait(timeout=20)
        return StepResult(None, float(met), True, {})


class Row:
    """The dataset row an episode is reset with (arith_feedback reads its label)."""

    label = "7"


def episodes(tiny_model_dir, envs, gate: threading.Event | None = None):
    """`envs`' episodes at once (their steps answer "7"), with the loop ticking beside them and
    setting `gate` at its third tick; (episodes, the thread of each tick)."""
    renderer = ObservationRenderer(load_tokenizer(tiny_model_dir), apply_chat_template=False)
    ticks = []

    async def go(threads):
        async def tick():  # the loop's own work (heartbeats, other episodes' requests)
            while True:
                ticks.append(threading.get_ident())
                if len(ticks) == 3 and gate is not None:
                    gate.set()
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        try:
            return await asyncio.gather(*(
                run_episode(generate, env, Row(), [3, 4], renderer, TurnLimits(2, 64, 4), {},
                            lambda ids: "7", threads) for env in envs))
        finally:
            ticker.cancel()

    threads = EnvThreads(4)
    try:
        return asyncio.run(go(threads)), ticks
    finally:
        threads.close()


def test_a_blocking_step_runs_in_a_thread_while_the_loop_drives_the_rest(tiny_model_dir):
    gate = threading.Event()
    envs = [Waits(gate), Waits(None)]
    eps, ticks = episodes(tiny_model_dir, envs, gate)
    # the loop turned while the first step blocked (on the loop it would wait 20 s for a gate
    # only the loop sets, and score 0)
    assert [ep.turn_rewards for ep in eps] == [[1.0], [1.0]]
    assert all(t != ticks[0] for env in envs for t in env.threads)


def test_environments_that_do_not_block_and_coroutines_stay_on_the_loop(tiny_model_dir):
    class Quick(ArithFeedbackEnv):  # a built-in (blocking = False), its step not overridden
        def reset(self, sample):
            self.thread = threading.get_ident()
            return super().reset(sample)

        blocking = False  # this class's reset too

    class Async(BaseEnv):
        async def step(self, model_text):
            self.thread = threading.get_ident()
            return StepResult(None, 1.0, True, {})

    envs = [Quick(), Async()]
    eps, ticks = episodes(tiny_model_dir, envs)
    assert [ep.turn_rewards[-1] for ep in eps] == [1.0, 1.0]
    assert [env.thread for env in envs] == [ticks[0], ticks[0]]


def test_a_built_ins_subclass_that_overrides_step_is_threaded_again(tiny_model_dir):
    """blocking = False speaks for the methods its own class defines: a user's subclass of
    arith_feedback whose step slept ran on the loop (seen in a run: every episode stopped)."""
    gate = threading.Event()

    class Slow(ArithFeedbackEnv):
        def step(self, model_text):
            self.thread = threading.get_ident()
            assert gate.wait(timeout=20)  # set by the loop's third tick
            return super().step(model_text)

    env = Slow()
    [ep], ticks = episodes(tiny_model_dir, [env], gate)
    assert ep.turn_rewards == [1.0] and env.thread != ticks[0]


def test_the_threads_say_how_many_calls_run_and_how_many_wait_for_a_thread():
    """The worker's heartbeat carries `load()`: with every thread taken the next calls wait,
    which the stall note names (launch/waiting.py). A call cancelled before a thread took it
    is not counted as waiting; one cancelled while it runs is counted until it ends."""
    gate = threading.Event()

    async def main():
        threads = EnvThreads(1)
        try:
            first = asyncio.ensure_future(threads.run(gate.wait, 20))
            second = asyncio.ensure_future(threads.run(gate.wait, 20))
            while threads.load()["busy"] < 1:  # the first call reached its thread
                await asyncio.sleep(0.01)
            full = threads.load()
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            dropped = threads.load()
            first.cancel()  # its thread still waits on the gate
            await asyncio.gather(first, return_exceptions=True)
            still = threads.load()
            gate.set()
            while threads.load()["busy"]:
                await asyncio.sleep(0.01)
            return full, dropped, still, threads.load()
        finally:
            threads.close()

    full, dropped, still, idle = asyncio.run(main())
    assert full == {"threads": 1, "busy": 1, "waiting": 1}
    assert dropped == {"threads": 1, "busy": 1, "waiting": 0}
    assert still == {"threads": 1, "busy": 1, "waiting": 0}
    assert idle == {"threads": 1, "busy": 0, "waiting": 0}
