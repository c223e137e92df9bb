"""The HTTP side of the proxy (rollout.agent_mode=proxy): OpenAI routes in front of
`AgentProxy` (rollout/proxy.py), served by the rollout worker in its own event loop.

    POST   /s/{group}/{name}/v1/chat/completions   OpenAI chat completion (n=1, no streaming)
    GET    /s/{group}/{name}/v1/models             the one model this run trains
    POST   /s/{group}/{name}/reward                {"reward": r}: ends the session
    DELETE /s/{group}/{name}                       abandons the session and drops its group
    GET    /health                                 200 once the engines answer (open)
    GET    /stats                                  open groups and sessions, groups sent

Inside a run every route but /health needs the run's secret as the API key
(`Authorization: Bearer <RUN_DIR/secret>`, what an OpenAI client sends as `api_key`): the
proxy's sessions become training data, so only who can read the run directory may add them.

Errors are OpenAI's shape, `{"error": {"message", "type", "code"}}`, with the HTTP code:
400 bad request or over a session's budget, 401 no or a wrong key, 404 unknown session, 409 a
request that does not fit the session's state, 502 engine failure, 503 no admission credit in
time / run ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relax_slurm.auth import bearer_matches, run_secret
from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.rollout.openai_chat import ProxyError
from relax_slurm.rollout.proxy import AgentProxy

log = logging.getLogger("relax_slurm.rollout.proxy")
REAP_EVERY_S = 5.0
SHUTDOWN_GRACE_S = 5.0


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ProxyError(400, f"the request body is not valid JSON: {e}") from e


async def _answer(proxy: AgentProxy, call: Callable[[], Awaitable[dict]]) -> JSONResponse:
    """The call's answer, or its error in OpenAI's shape; 503 once the run is ending, whatever
    the call was waiting for (`AgentProxy.unless_closing`)."""
    try:
        return JSONResponse(await proxy.unless_closing(call()))
    except ProxyError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:  # a bug, not the agent's fault: say so and keep serving
        log.exception("proxy request failed")
        return JSONResponse(ProxyError(500, f"{type(e).__name__}: {e}", "server_error").body(),
                            status_code=500)


def build_app(proxy: AgentProxy, secret: str | None = None) -> FastAPI:
    """The routes; with `secret`, every one but /health needs it as the bearer token."""
    app = FastAPI(title="relax-slurm agent proxy")
    model = proxy.cfg.model.path

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if secret is None or request.url.path == "/health" \
                or bearer_matches(secret, request.headers.get("authorization")):
            return await call_next(request)
        error = ProxyError(401, "missing or wrong API key: send the run's secret "
                                "(RUN_DIR/secret) as `Authorization: Bearer ...`, i.e. "
                                "OpenAI(api_key=...)", "invalid_api_key")
        return JSONResponse(error.body(), status_code=401)

    @app.post("/s/{group}/{name}/v1/chat/completions")
    async def chat(group: str, name: str, request: Request) -> JSONResponse:
        async def call() -> dict:
            return await proxy.chat(group, name, await _json_body(request))
        return await _answer(proxy, call)

    @app.get("/s/{group}/{name}/v1/models")
    async def models(group: str, name: str) -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model",
                                            "owned_by": "relax-slurm"}]}

    @app.post("/s/{group}/{name}/reward")
    async def reward(group: str, name: str, request: Request) -> JSONResponse:
        async def call() -> dict:
            body = await _json_body(request)
            if not isinstance(body, dict) or "reward" not in body:
                raise ProxyError(400, 'the body must be {"reward": <number>}')
            return await proxy.end(group, name, body["reward"])
        return await _answer(proxy, call)

    @app.delete("/s/{group}/{name}")
    async def abandon(group: str, name: str) -> JSONResponse:
        return await _answer(proxy, lambda: proxy.abandon(group, name))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        return proxy.stats()

    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the worker's loop handles SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _housekeeping(proxy: AgentProxy, role: str) -> None:
    """Drop idle groups, and heartbeat to the broker from this loop (the launcher's hang
    check: a beat means the proxy's event loop turns)."""
    beat = Pacer(proxy.cfg.cluster.restart.heartbeat_interval_s)
    while True:
        if beat.due():
            await proxy.svc.broker.heartbeat(role, **proxy.stats())
        await proxy.reap_idle()
        await asyncio.sleep(min(REAP_EVERY_S, beat.interval_s))


async def serve_proxy(proxy: AgentProxy, stop: asyncio.Event, role: str, host: str,
                      port: int) -> None:
    """Serve the proxy until `stop` is set, heartbeating as `role`; a server that fails (e.g.
    the port is taken) fails the worker."""
    # once `closing` is set every open request answers 503 at once (`_answer`); the grace
    # is for those answers to leave
    server = _Server(uvicorn.Config(build_app(proxy, run_secret()), host=host, port=port,
                                   log_level="warning", lifespan="off",
                                   timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    serving = asyncio.create_task(server.serve())
    reaper = asyncio.create_task(_housekeeping(proxy, role))
    stopping = asyncio.create_task(stop.wait())
    log.info("agent proxy serving at http://%s:%d/s/{group}/{name}/v1 (groups of %d sessions)",
             host, port, proxy.n)
    try:
        done, _ = await asyncio.wait({serving, reaper, stopping},
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in done & {serving, reaper}:
            if task.exception() is not None:
                raise task.exception()
            if task is serving and not server.should_exit:
                raise RuntimeError(f"the agent proxy on {host}:{port} stopped serving")
    finally:
        proxy.closing.set()  # requests parked for a credit answer 503 now
        server.should_exit = True
        reaper.cancel()
        stopping.cancel()
        await asyncio.gather(serving, reaper, stopping, return_exceptions=True)
