"""wait_until_healthy against real sockets: an engine that comes up late, one that never does,
and the launcher's between-polls check."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_slurm.errors import EngineDown
from relax_slurm.engines.client import wait_until_healthy
from tests.helpers_tiny import free_port


class LateEngine(BaseHTTPRequestHandler):
    """GET /health: 503 for the first `ready_after` polls, then 200."""

    ready_after = 0
    polls = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).polls += 1
        ok = self.path == "/health" and self.polls > self.ready_after
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def late_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), LateEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", LateEngine
    server.shutdown()
    server.server_close()


def test_returns_once_every_engine_answers(late_engine):
    url, handler = late_engine
    handler.ready_after, handler.polls = 3, 0
    rounds = []
    wait_until_healthy([url], timeout_s=60, poll_s=0.05, between_polls=lambda: rounds.append(1))
    assert handler.polls == 4 and len(rounds) == 4  # one check per round


def test_names_the_engine_still_down(late_engine):
    url, handler = late_engine
    handler.ready_after = 0  # healthy at once
    down = f"http://127.0.0.1:{free_port()}"  # nobody listens
    t0 = time.monotonic()
    with pytest.raises(EngineDown) as e:
        wait_until_healthy([url, down], timeout_s=1.0, poll_s=0.1)
    assert e.value.url == down and "rollout.startup_timeout_s=1.0" in str(e.value)
    assert 1.0 <= time.monotonic() - t0 < 10


def test_a_failing_check_ends_the_wait(late_engine):
    url, handler = late_engine
    handler.ready_after = 10**9  # never healthy

    class RoleDied(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise RoleDied

    with pytest.raises(RoleDied):
        wait_until_healthy([url], timeout_s=60, poll_s=0.05, between_polls=check)
