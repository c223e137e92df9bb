"""The tool environment: parsing `<tool_call>` blocks, the calculator, the sandboxed Python
runner's limits, and failing tools becoming error observations rather than crashes."""

from __future__ import annotations

import asyncio
import time

import pytest

from relax_slurm.envs import BaseEnv, EnvError, StepResult, env_factory, names, register_env
from relax_slurm.envs.arith_feedback import ArithFeedbackEnv
from relax_slurm.envs.sandbox import run_python
from relax_slurm.envs.tools import Tool, ToolEnv, calculate, parse_tool_calls


def run(coro):
    return asyncio.run(coro)


def call(name, **arguments):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_parse_tool_calls_qwen_convention():
    text = ("Let me compute.\n" + call("calculator", expression="2+3") + "\nand\n"
            + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'
            + "</tool_call>")
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, None), ("python", {"code": "print(1)"}, None)]
    assert parse_tool_calls("no calls here") == []
    bad = parse_tool_calls("<tool_call>{not json</tool_call><tool_call>[1]</tool_call>")
    assert len(bad) == 2 and all(c.error for c in bad)
    # an unclosed block at the end (stopped by the token limit) is still a call
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}')[0].name \
        == "calculator"


def test_calculator():
    assert calculate("12*(3+4)") == "84"
    assert calculate("7/2") == "3.5"
    assert calculate("-2**3 + 10 % 4") == "-6"
    for bad in ("__import__('os')", "x+1", "9**9**9", "1/0", "2**10000", "[1]"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_sandbox_runs_and_limits():
    # snippets that should finish get room for a loaded 2-core machine (a python start-up
    # alone has taken seconds there); the endless loop keeps its 1 s limit
    room = {"timeout_s": 30.0}
    ok = run(run_python("import sys; print(sum(range(10))); print('e', file=sys.stderr)", **room))
    assert ok.ok and ok.stdout == "45\n" and ok.stderr == "e\n"
    t0 = time.monotonic()
    slow = run(run_python("while True: pass", timeout_s=1.0))
    assert slow.timed_out and not slow.ok and time.monotonic() - t0 < 10
    hog = run(run_python("x = bytearray(400 * 2**20)\nprint('allocated')", memory_mb=128, **room))
    assert hog.exit_code != 0 and "MemoryError" in hog.stderr and "allocated" not in hog.stdout
    chatty = run(run_python("print('x' * 10**6)", max_output_bytes=100, **room))
    assert chatty.ok and chatty.truncated and len(chatty.stdout) == 100
    raised = run(run_python("raise ValueError('boom')", **room))
    assert raised.exit_code == 1 and "ValueError: boom" in raised.stderr
    # isolated: no environment of ours, a temporary working directory
    env = run(run_python("import os; print(sorted(os.environ)); print(os.getcwd())", **room))
    assert "PYTHONPATH" not in env.stdout and "relax_sandbox_" in env.stdout


def test_tool_env_results_and_errors_never_crash():
    def explode(**_):
        raise RuntimeError("tool is broken")

    async def hang(**_):
        await asyncio.sleep(60)

    # generous enough for a snippet to start on a loaded 2-core machine
    env = ToolEnv(tool_timeout_s=4.0, python_timeout_s=3.0, extra_tools=[
        Tool("explode", "raises", {"type": "object", "properties": {}}, explode),
        Tool("hang", "never returns", {"type": "object", "properties": {}}, hang)])
    assert {t["function"]["name"] for t in env.tools} == {"calculator", "python", "explode",
                                                          "hang"}
    assert env.stop == ("</tool_call>",)

    async def main():
        env.reset(None)
        turn = "".join([call("calculator", expression="6*7"),
                        call("explode"), call("hang"), call("nope"),
                        call("calculator", wrong_arg="1"),
                        call("python", code="while True: pass"),
                        "<tool_call>{oops</tool_call>"])
        t0 = time.monotonic()
        obs, reward, done, info = await env.step(turn)
        return obs, reward, done, info, time.monotonic() - t0

    env.max_calls_per_turn = 10
    obs, reward, done, info, took = run(main())
    assert not done and reward == 0.0 and took < 40
    contents = [m["content"] for m in obs]
    assert all(m["role"] == "tool" for m in obs)
    assert contents[0] == "42"
    assert contents[1].startswith("error: explode failed: RuntimeError: tool is broken")
    assert contents[2] == "error: hang timed out after 4s"
    assert contents[3].startswith("error: unknown tool 'nope'")
    assert contents[4].startswith("error: bad arguments for calculator")
    # the sandbox's own limit (3 s) or, on a loaded machine, the tool timeout (4 s) stops it
    assert contents[5].startswith("error: python") and ("ran longer than 3s" in contents[5]
                                                        or "timed out after 4s" in contents[5])
    assert contents[6].startswith("error: cannot parse tool call as JSON")
    assert env.num_errors == 6

    # a snippet that finishes, under limits a loaded machine's python start-up cannot reach
    # (beside the endless loop above, 3 s once was close)
    roomy = ToolEnv(tool_timeout_s=60.0, python_timeout_s=30.0)

    async def snippet():
        roomy.reset(None)
        return await roomy.step(call("python", code="print(2**5)"))

    obs, *_ = run(snippet())
    assert [m["content"] for m in obs] == ["32\n"] and roomy.num_errors == 0
    # formatted as tool messages; the answer without a call ends the episode
    assert env.format_observation(obs) == obs
    final = run(env.step("The answer is 42."))
    assert final.done and final.observation is None and final.info["tool_errors"] == 6


def test_too_many_calls_per_turn_are_answered_with_an_error():
    env = ToolEnv(tools=["calculator"], max_calls_per_turn=1)
    obs = run(env.step(call("calculator", expression="1+1") * 2)).observation
    assert obs[0]["content"] == "2" and obs[1]["content"].startswith("error: at most 1")


def test_registry_by_name_and_dotted_path():
    assert {"tool", "arith_feedback"} <= set(names())
    make = env_factory("arith_feedback", {"max_tries": 2})
    a, b = make(), make()
    assert isinstance(a, ArithFeedbackEnv) and a is not b  # one per episode
    assert isinstance(env_factory("relax_slurm.envs.tools:ToolEnv",
                                  {"tools": ["calculator"]})(), ToolEnv)
    with pytest.raises(EnvError, match="not a registered environment"):
        env_factory("nope")
    with pytest.raises(EnvError, match="cannot import"):
        env_factory("no_such_module_x:Env")
    with pytest.raises(EnvError, match="env.kwargs"):
        env_factory("arith_feedback", {"bogus": 1})

    @register_env("test_echo_env")
    class Echo(BaseEnv):
        def step(self, text):
            return StepResult(text, 0.0, False)

    assert isinstance(env_factory("test_echo_env")(), Echo)
    with pytest.raises(ValueError, match="already registered"):
        register_env("test_echo_env")(ToolEnv)


def test_arith_feedback_hints_and_discounted_reward():
    class Row:
        label = "7"

    env = ArithFeedbackEnv(discount=0.5, max_tries=3)
    assert env.reset(Row()) == (None, {})
    assert env.step("5") == StepResult("+", 0.0, False, {"tries": 1})
    assert env.step("x") == StepResult("*", 0.0, False, {"tries": 2})
    assert env.step("7") == StepResult(None, 0.25, True, {"tries": 3})
    env.reset(Row())
    assert env.step("9").observation == "-"
    env.step("8")
    last = env.step("9")
    assert last.done and last.reward == 0.0 and last.observation is None
    assert env.format_observation("+") == [{"role": "user", "content": "+"}]
