"""Tool calling: parse `<tool_call>` JSON in the model's turn, run the tools, answer with results.

The convention is the one the Qwen chat templates teach in their tools section:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

(`arguments` may also be a JSON string, as OpenAI sends it). Every call in a turn is run, in
order, and its result becomes one `{"role": "tool", "name": ..., "content": ...}` message, which
the template renders (Qwen: inside `<tool_response>`). A call that cannot be parsed, names an
unknown tool, has bad arguments, raises or times out becomes an error result ("error: ..."),
never an exception: the model sees what went wrong and may try again.

`ToolEnv` (registered as `tool`): a turn with tool calls gets their results; the first turn
without a tool call is the final answer and ends the episode (reward 0 from the environment:
score the trajectory with a reward function, env.reward_source=reward_fn).

Built-in tools: `calculator` (arithmetic on numbers, no names, bounded exponents) and `python`
(a snippet run by envs/sandbox.py with time, memory and output limits; its stdout is the result).
Add your own with `Tool(name, description, parameters, fn)`; `fn` takes the arguments as
keywords and may be a coroutine function. A plain function runs in a thread (so it cannot block
the event loop); a thread cannot be killed, so a sync tool that may hang should run in a
process of its own, as `python` does.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from relax_slurm.envs.base import BaseEnv, Message, StepResult
from relax_slurm.envs.registration import register_env
from relax_slurm.envs.sandbox import run_python

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    name: Optional[str]
    arguments: dict[str, Any]
    error: Optional[str] = None
    """Why the call could not be parsed (then name may be None)."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of `text`, in order (an unclosed last block
    counts: the model may have been stopped at the limit)."""
    calls = []
    for m in TOOL_CALL_RE.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"cannot parse tool call as JSON ({e.msg} at "
                                             f"column {e.colno}): {body[:200]!r}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call is a JSON object {"name": <tool>, '
                                             f'"arguments": {{...}}}}, got {body[:200]!r}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                calls.append(ToolCall(obj["name"], {}, f"arguments are not JSON: {args[:200]!r}"))
                continue
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, f"arguments must be an object, got "
                                                   f"{type(args).__name__}"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object schema)."""
    fn: Callable[..., Any] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Qwen function schema the chat template renders in its tools section."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


# ---- calculator -------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10 ** 100


def calculate(expression: str) -> str:
    """Evaluate arithmetic on numbers (+ - * / // % ** and parentheses); ValueError otherwise.
    Integers stay exact; a division gives a float; results are bounded (no 9**9**9)."""
    if not isinstance(expression, str) or len(expression) > 500:
        raise ValueError("expression must be a string of at most 500 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return value
        raise ValueError(f"unsupported element {type(node).__name__} in {expression!r}: only "
                         "numbers, + - * / // % ** and parentheses")

    try:
        value = ev(tree)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        return format(value, ".12g")
    return str(value)


CALCULATOR = Tool(
    name="calculator", description="Evaluate an arithmetic expression (+ - * / // % ** ( )).",
    parameters={"type": "object", "properties": {"expression": {
        "type": "string", "description": "for example 12*(3+4)"}}, "required": ["expression"]},
    fn=calculate)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 512,
                max_output_bytes: int = 4096) -> Tool:
    """A `python` tool running snippets in the sandbox with these limits."""

    async def run(code: str) -> str:
        if not isinstance(code, str):
            raise ValueError("code must be a string")
        res = await run_python(code, timeout_s=timeout_s, memory_mb=memory_mb,
                               max_output_bytes=max_output_bytes)
        if res.timed_out:
            raise TimeoutError(f"the snippet ran longer than {timeout_s:g}s and was killed")
        out = res.stdout + ("\n[output truncated]" if res.truncated else "")
        if res.exit_code != 0:
            tail = res.stderr.strip().splitlines()[-1:] or [f"exit code {res.exit_code}"]
            if res.exit_code is not None and res.exit_code < 0:
                tail = [f"killed by signal {-res.exit_code} (memory or CPU limit?)"]
            raise RuntimeError(f"{tail[0]}" + (f"\nstdout:\n{out}" if out.strip() else ""))
        return out

    return Tool(
        name="python", description="Run a Python snippet and return what it prints.",
        parameters={"type": "object", "properties": {"code": {
            "type": "string", "description": "Python source; print the result"}},
            "required": ["code"]},
        fn=run)


async def call_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
    """(result text, error?) of one call; exceptions and timeouts become error results."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as e:
        return f"error: bad arguments for {tool.name}: {e}", True
    try:
        if inspect.iscoroutinefunction(tool.fn):
            call: Awaitable[Any] = tool.fn(**arguments)
        else:
            call = asyncio.to_thread(tool.fn, **arguments)
        result = await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        return f"error: {tool.name} timed out after {timeout_s:g}s", True
    except Exception as e:  # a tool's failure is an observation, not a crash
        return f"error: {tool.name} failed: {type(e).__name__}: {e}", True
    if not isinstance(result, str):
        result = json.dumps(result) if isinstance(result, (dict, list)) else str(result)
    return result, False


@register_env("tool")
class ToolEnv(BaseEnv):
    """Tool calls in, tool results out; the first turn without a call ends the episode.

    kwargs (env.kwargs): `tools` (names of built-ins: calculator, python; default both),
    `tool_timeout_s` (per call, default 10), `python_timeout_s` (5), `python_memory_mb` (512),
    `max_calls_per_turn` (4; more are answered with an error), `max_result_chars` (2000).
    """

    stop = (TOOL_CALL_END,)
    observation_role = "tool"
    blocking = False  # step is async (tools run in subprocesses or threads of their own)

    def __init__(self, tools: Optional[list[str]] = None, tool_timeout_s: float = 10.0,
                 python_timeout_s: float = 5.0, python_memory_mb: int = 512,
                 max_calls_per_turn: int = 4, max_result_chars: int = 2000,
                 extra_tools: Optional[list[Tool]] = None) -> None:
        builtins = {"calculator": CALCULATOR,
                    "python": python_tool(python_timeout_s, python_memory_mb)}
        chosen = list(builtins) if tools is None else list(tools)
        unknown = [t for t in chosen if t not in builtins]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; built-ins are {sorted(builtins)}")
        self.registry: dict[str, Tool] = {n: builtins[n] for n in chosen}
        for tool in extra_tools or []:
            self.registry[tool.name] = tool
        self.tools = [t.schema() for t in self.registry.values()]
        self.tool_timeout_s = tool_timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.num_calls = self.num_errors = 0

    async def run_calls(self, calls: list[ToolCall]) -> list[Message]:
        out = []
        for i, call in enumerate(calls):
            name = call.name or "unknown"
            if i >= self.max_calls_per_turn:
                text, error = (f"error: at most {self.max_calls_per_turn} tool calls per turn",
                               True)
            elif call.error is not None:
                text, error = f"error: {call.error}", True
            elif call.name not in self.registry:
                text, error = (f"error: unknown tool {call.name!r}; available: "
                               f"{', '.join(self.registry)}", True)
            else:
                text, error = await call_tool(self.registry[call.name], call.arguments,
                                              self.tool_timeout_s)
            if len(text) > self.max_result_chars:
                text = text[:self.max_result_chars] + "...[truncated]"
            self.num_calls += 1
            self.num_errors += int(error)
            out.append({"role": "tool", "name": name, "content": text})
        return out

    async def step(self, model_text: str) -> StepResult:
        calls = parse_tool_calls(model_text)
        if not calls:  # the final answer
            return StepResult(None, 0.0, True, {"tool_calls": self.num_calls,
                                                "tool_errors": self.num_errors})
        results = await self.run_calls(calls)
        return StepResult(results, 0.0, False, {"tool_calls": len(calls)})
