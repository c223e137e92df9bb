"""Sessions of the OpenAI-compatible proxy (rollout.agent_mode=proxy): external agents' turns,
recorded token in, token out, and handed to the broker as groups.

An agent program is trained by pointing its OpenAI client at a session of the run (the HTTP
side is rollout/proxy_server.py):

    client = OpenAI(base_url=f"{proxy_url}/s/{group}/{name}/v1", api_key=RUN_SECRET)
    client.chat.completions.create(model="policy", messages=[...])   # as many turns as it takes
    httpx.post(f"{proxy_url}/s/{group}/{name}/reward", json={"reward": 1.0},
               headers={"Authorization": f"Bearer {RUN_SECRET}"})            # ends it

A *session* is one conversation: one episode, one trainable sample. A *group* is the
`rollout.n_samples_per_prompt` sessions the GRPO family compares (typically n attempts at one
task); both are named by the agent in the URL. The first request of a new group waits for an
admission credit from the broker (the staleness bound, as the worker's prompts do); every
session of a group goes to one engine (sticky: its prefix cache holds their histories). When
all n sessions have a reward the group goes to the broker exactly like the worker's episodes
(`RolloutServices.put_episodes`: overlong penalty, dynamic sampling, `episode_sample`).

Token in, token out: the first request's messages (and `tools`) are rendered with the chat
template into the session's prompt ids. Every later request repeats the conversation so far,
the assistant replies exactly as returned, and adds messages (tool results, the user's next
turn); only those are rendered (`ObservationRenderer.between_turns`) and appended after the ids
the model sampled, which are never re-tokenised. Model tokens get loss mask 1 and their
log-probs, the rest 0. A request that rewrites the history is refused (409).

Limits per session: env.max_turns model turns and env.max_total_tokens tokens (a request past
them is answered 400 and the session marked truncated; end it with a reward as usual).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

from relax_slurm.data.chat import render
from relax_slurm.errors import BrokerShutdown, EngineError
from relax_slurm.rollout.multiturn import Episode, ObservationRenderer, TurnLimits
from relax_slurm.rollout.openai_chat import (
    ChatRequest, Message, ProxyError, new_messages, parse_chat_request,
)

if TYPE_CHECKING:
    from relax_slurm.rollout.services import RolloutServices

log = logging.getLogger("relax_slurm.rollout.proxy")
ACQUIRE_WAIT_S = 2.0
T = TypeVar("T")


@dataclass
class Session:
    name: str
    episode: Episode | None = None
    history: list[Message] = field(default_factory=list)
    """Every message so far, the assistant replies as returned."""
    last_output_ids: list[int] = field(default_factory=list)
    busy: bool = False
    reward: float | None = None


@dataclass
class GroupState:
    name: str
    gid: int
    engine: int
    admission: asyncio.Future
    t_start: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    sessions: dict[str, Session] = field(default_factory=dict)


class AgentProxy:
    """The proxy's sessions and groups, on the rollout worker's engines and broker."""

    def __init__(self, svc: RolloutServices) -> None:
        self.svc, self.cfg = svc, svc.cfg
        self.renderer = ObservationRenderer(svc.tokenizer, self.cfg.data.apply_chat_template)
        self.limits = TurnLimits.of(self.cfg)
        self.n = self.cfg.rollout.n_samples_per_prompt
        self.groups: dict[str, GroupState] = {}
        self.finished: set[str] = set()
        """Names of groups sent or dropped: reusing one is refused."""
        self.load = [0] * len(svc.router.engines)  # open groups per engine
        self.counts = {"groups_sent": 0, "groups_filtered": 0, "groups_dropped": 0}
        self.closing = asyncio.Event()
        """Set when the run is ending: new requests and requests parked for a credit get 503."""

    # ---- requests ----------------------------------------------------------------------

    async def chat(self, group: str, name: str, body: Any) -> dict[str, Any]:
        """One chat completion of session `group/name` (created by its first request)."""
        req = parse_chat_request(body)
        self._check_open()
        g = await self._group(group)
        s = g.sessions.get(name)
        if s is None:
            if len(g.sessions) >= self.n:
                raise ProxyError(409, f"group {group!r} has its {self.n} sessions "
                                      f"(rollout.n_samples_per_prompt) already: use another "
                                      "group name for more", "conflict")
            s = g.sessions[name] = Session(name)
        if s.reward is not None:
            raise ProxyError(409, f"session {group}/{name} has ended (it has a reward)",
                             "conflict")
        if s.busy:
            raise ProxyError(409, f"session {group}/{name} is still answering a request: a "
                                  "session is one conversation, wait for its reply", "conflict")
        s.busy = True
        try:
            return await self._turn(g, s, req)
        finally:
            s.busy = False
            g.last_active = time.monotonic()

    async def end(self, group: str, name: str, reward: Any) -> dict[str, Any]:
        """Close session `group/name` with its final reward; a group whose n sessions all have
        one goes to the broker."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ProxyError(400, f"`reward`={reward!r}: expected a number")
        self._check_open()  # a reward now could not reach the broker: refused before any change
        g, s = self._known(group, name)
        if s.busy:
            raise ProxyError(409, f"session {group}/{name} is still answering a request",
                             "conflict")
        if s.reward is not None:
            raise ProxyError(409, f"session {group}/{name} already has a reward", "conflict")
        if s.episode is None or s.episode.turns == 0:
            raise ProxyError(409, f"session {group}/{name} has no model turn to train on: send "
                                  "a chat request first, or DELETE the session", "conflict")
        s.reward = float(reward)
        g.last_active = time.monotonic()
        ended = [x for x in g.sessions.values() if x.reward is not None]
        if len(ended) < self.n:
            return {"group_complete": False, "sessions_ended": len(ended)}
        self._close(g)
        sent = await self.svc.put_episodes(
            group, g.gid, [x.episode for x in ended], [x.reward for x in ended], 0,
            {"t_start": g.t_start, "t_end": time.time(), "data_state": None,
             "agent_group": group})
        self.counts["groups_sent" if sent else "groups_filtered"] += 1
        return {"group_complete": True, "sessions_ended": len(ended), "sent": sent}

    async def abandon(self, group: str, name: str) -> dict[str, Any]:
        """Drop the session and with it its group (a group is trained whole or not at all)."""
        self._check_open()
        g, _ = self._known(group, name)
        await self._drop(g, f"session {name} abandoned")
        return {"dropped_group": group}

    def stats(self) -> dict[str, Any]:
        return {"open_groups": len(self.groups),
                "open_sessions": sum(len(g.sessions) for g in self.groups.values()),
                **self.counts}

    # ---- groups ------------------------------------------------------------------------

    def _known(self, group: str, name: str) -> tuple[GroupState, Session]:
        g = self.groups.get(group)
        s = g.sessions.get(name) if g is not None else None
        if s is None:
            raise ProxyError(404, f"unknown session {group}/{name}: it never sent a chat "
                                  "request, or its group was already sent or dropped",
                             "not_found")
        return g, s

    async def _group(self, name: str) -> GroupState:
        g = self.groups.get(name)
        if g is None:
            if name in self.finished:
                raise ProxyError(409, f"group {name!r} was already sent or dropped: use a new "
                                      "group name", "conflict")
            engine = min(range(len(self.load)), key=self.load.__getitem__)
            self.load[engine] += 1
            g = self.groups[name] = GroupState(
                name=name, gid=next(self.svc.group_ids), engine=engine,
                admission=asyncio.ensure_future(self._acquire()))
        try:
            await asyncio.shield(g.admission)
        except BaseException:
            if self.groups.get(name) is g:  # no credit: forget the group, nothing to release
                self.groups.pop(name)
                self.load[g.engine] -= 1
            raise
        return g

    async def _acquire(self) -> None:
        """One admission credit for a new group, or ProxyError(503) after the timeout."""
        timeout_s = self.cfg.rollout.proxy_admission_timeout_s
        deadline = time.monotonic() + timeout_s
        while not await self.unless_closing(self.svc.broker.acquire(
                1, wait_s=min(ACQUIRE_WAIT_S, max(0.0, deadline - time.monotonic())))):
            if time.monotonic() >= deadline:
                raise ProxyError(503, f"no admission credit for a new group within "
                                      f"rollout.proxy_admission_timeout_s={timeout_s}s: the "
                                      "trainer is behind (algo.max_staleness bounds how far "
                                      "rollout runs ahead); retry later", "server_busy")

    def _check_open(self) -> None:
        if self.closing.is_set():
            raise ProxyError(503, "the run is ending: the proxy takes no more requests",
                             "server_busy")

    async def unless_closing(self, call: Awaitable[T]) -> T:
        """`call`'s result, or ProxyError(503) as soon as the run is ending. Every request is
        answered through this (proxy_server.py): at the end of a run the broker and the engines
        stop with the worker, and a request parked on one of them would otherwise outlast the
        server's shutdown grace, which uvicorn ends by cancelling it and answering a bare 500."""
        task = asyncio.ensure_future(call)
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            done, _ = await asyncio.wait({task, closing}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled from outside: take the call down with it
            task.cancel()
            raise
        finally:
            closing.cancel()
        if task not in done:
            task.cancel()
            self._check_open()
        try:
            return task.result()
        except BrokerShutdown as e:  # a parked broker call refused: the broker is stopping
            raise ProxyError(503, f"the run is ending: {e}", "server_busy") from e

    def _close(self, g: GroupState) -> None:
        self.groups.pop(g.name, None)
        self.finished.add(g.name)
        self.load[g.engine] -= 1

    async def _drop(self, g: GroupState, why: str) -> None:
        if self.groups.get(g.name) is not g:
            return
        self._close(g)
        self.counts["groups_dropped"] += 1
        log.warning("dropped group %s (%s); its admission credit goes back", g.name, why)
        await self.svc.broker.release(1)

    async def reap_idle(self) -> None:
        """Drop groups idle for rollout.proxy_session_timeout_s (their agent is gone)."""
        timeout_s = self.cfg.rollout.proxy_session_timeout_s
        now = time.monotonic()
        for g in list(self.groups.values()):
            if g.admission.done() and now - g.last_active > timeout_s \
                    and not any(s.busy for s in g.sessions.values()):
                await self._drop(g, f"no request for rollout.proxy_session_timeout_s="
                                    f"{timeout_s}s")

    # ---- one turn ----------------------------------------------------------------------

    def _prompt_ids(self, req: ChatRequest) -> list[int]:
        text = render(self.svc.tokenizer, req.messages, self.cfg.data.apply_chat_template,
                      tools=req.tools)
        add_special = not self.cfg.data.apply_chat_template  # as data/chat.py encodes
        return list(self.svc.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def _params(self, req: ChatRequest, room: int) -> dict[str, Any]:
        r = self.cfg.rollout
        params = {"max_new_tokens": min(req.max_tokens or r.max_new_tokens, room),
                  "temperature": r.temperature if req.temperature is None else req.temperature,
                  "top_p": r.top_p if req.top_p is None else req.top_p, "top_k": r.top_k}
        if req.stop:
            params["stop"] = list(req.stop)
        if req.seed is not None:
            params["sampling_seed"] = req.seed
        return params

    async def _turn(self, g: GroupState, s: Session, req: ChatRequest) -> dict[str, Any]:
        limits = self.limits
        where = f"session {g.name}/{s.name}"
        if s.episode is None:
            ep, between = Episode(prompt_ids=self._prompt_ids(req)), []
        else:
            ep = s.episode
            added = new_messages(s.history, req.messages)
            if ep.turns >= limits.max_turns:
                ep.end = "max_turns"
                raise ProxyError(400, f"{where} has taken env.max_turns={limits.max_turns} "
                                      "model turns: end it with a reward", "max_turns_exceeded")
            between = self.renderer.between_turns(s.last_output_ids, added)
        room = ep.room(limits.max_total_tokens) - len(between)
        if room <= 0:
            if s.episode is not None:
                ep.end = "max_total_tokens"
            total = ep.total_tokens + len(between)
            raise ProxyError(400, f"{where} would pass env.max_total_tokens="
                                  f"{limits.max_total_tokens} tokens ({total} "
                                  "with the new messages): end it with a reward",
                             "context_length_exceeded")
        ids = ep.prompt_ids + ep.response_ids + between
        try:
            engine = self.svc.router.engines[g.engine]
            # routed experts of the positions no earlier turn covered (routing.segments)
            [res] = await engine.generate([ids], [self._params(req, room)],
                                          routed_start=ep.routing.start_for(ids))
        except EngineError as e:
            raise ProxyError(502, f"the engine failed: {e}", "engine_error") from e
        if res.finish_reason == "abort":
            raise ProxyError(503, "the engine aborted the generation (it is being updated or "
                                  "stopped): retry the request", "server_busy")
        ep.add(between, model=False)
        ep.add_turn(res, ids)
        ep.end = "done"  # a refused request before this one no longer ends the session
        content = res.text if req.stop else self.svc.decode(res.output_ids)
        ep.last_turn_text = content
        s.episode = ep
        s.history = [*req.messages, {"role": "assistant", "content": content}]
        s.last_output_ids = list(res.output_ids)
        return self._response(req, res, content, len(ids))

    def _response(self, req: ChatRequest, res: Any, content: str, prompt_tokens: int
                  ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": content},
            "finish_reason": "length" if res.finish_reason == "length" else "stop",
            "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [
                {"token": self.svc.tokenizer.decode([t]), "logprob": lp, "bytes": None,
                 "top_logprobs": []} for t, lp in zip(res.output_ids, res.logprobs)]}
        n_out = len(res.output_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": req.model or self.cfg.model.path,
                "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out,
                          "total_tokens": prompt_tokens + n_out}}
