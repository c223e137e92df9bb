"""OpenAI chat-completions requests as the agent proxy reads them (rollout/proxy.py): parsing
and validation of a body, and the rule that a session's conversation only grows.

Pure functions; every refusal is a `ProxyError` carrying its HTTP status and OpenAI's error
shape, with the fix in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_slurm.errors import RelaxError

Message = dict[str, Any]
# OpenAI parameters the engines cannot honour: refused unless at their default
_UNSUPPORTED = {"n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0,
                "logit_bias": None, "top_logprobs": None}
_KEPT_KEYS = ("name", "tool_call_id")  # message keys a chat template may render


class ProxyError(RelaxError):
    """A request the proxy refuses; `status` is its HTTP code, the message says the fix."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": str(self), "type": self.kind, "code": self.status}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[Message]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    model: str = ""


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ProxyError(400, f"messages[{i}].content must be a string or text parts; the proxy "
                          "carries text only (send tool calls back as the assistant's text, as "
                          "the model wrote them)")


def normalize_messages(messages: Any) -> list[Message]:
    """Validated {"role", "content"} messages (plus `name` / `tool_call_id` when given)."""
    if not isinstance(messages, list) or not messages:
        raise ProxyError(400, "`messages` must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProxyError(400, f"messages[{i}] must be an object with a string `role`")
        msg = {"role": m["role"], "content": _text(m.get("content"), i)}
        msg.update({k: m[k] for k in _KEPT_KEYS if isinstance(m.get(k), str)})
        out.append(msg)
    return out


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (integer and not float(value).is_integer()) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ProxyError(400, f"`{key}`={value!r}: expected {kind} in [{lo}, {hi}]")
    return int(value) if integer else float(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """An OpenAI chat-completions body -> ChatRequest; ProxyError(400) names what is wrong."""
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body must be a JSON object")
    for key, default in _UNSUPPORTED.items():
        if body.get(key) not in (None, default):
            raise ProxyError(400, f"`{key}`={body[key]!r} is not supported by the training "
                                  f"proxy (only {default!r}): one sampled answer per request")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise ProxyError(400, "`stop` must be a string or a list of non-empty strings")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ProxyError(400, "`tools` must be a list of function schemas")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        messages=normalize_messages(body.get("messages")), tools=tools or None,
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", 1, 2**31, integer=True),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-9, 1.0), stop=stop,
        seed=_number(body, "seed", 0, 2**63 - 1, integer=True),
        logprobs=bool(body.get("logprobs") or False), model=str(body.get("model") or ""))


def new_messages(history: list[Message], messages: list[Message]) -> list[Message]:
    """What `messages` add to a session's `history`; ProxyError(409) if they rewrite it."""
    for i, (old, new) in enumerate(zip(history, messages)):
        if (old["role"], old["content"]) != (new["role"], new["content"]):
            raise ProxyError(409, f"messages[{i}] ({new['role']}) differs from the session's "
                                  "history: a session is one conversation that only grows. Send "
                                  "the earlier messages and the assistant replies exactly as "
                                  "returned, or start a new session", "conflict")
    if len(messages) <= len(history):
        raise ProxyError(409, f"{len(messages)} messages do not extend the session's "
                              f"{len(history)}: add the next user or tool message", "conflict")
    return messages[len(history):]
