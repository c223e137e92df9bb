"""What a failed sync says about each engine (WeightSender._not_answered): real HTTP servers and
real client errors, the engines' calls as futures the test completes."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_slurm.engines.client import EngineClient
from relax_slurm.weightsync.sender import WeightSender

ROUTE = "/update_weights_from_distributed"


class _Engine:
    """Answers GET /model_info at once and holds every POST for `hold_s`."""

    def __init__(self, hold_s: float = 0.0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self) -> None:
                time.sleep(hold_s)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _closed_url() -> str:
    with socket.socket() as s:  # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _failed_post(url: str, timeout_s: float) -> Future:
    """A finished engine call: the client's own error for a POST of ROUTE to `url`."""
    fut: Future = Future()
    with EngineClient(url, timeout_s) as client:
        try:
            client._call("POST", ROUTE)
        except Exception as e:  # noqa: BLE001 - the client's own error is what the test wants
            fut.set_exception(e)
        else:
            pytest.fail("the call was meant to fail")
    return fut


def test_a_failed_sync_names_the_silent_engine_and_keeps_a_cut_calls_own_words():
    cut, waiting, slow = _Engine(), _Engine(), _Engine(hold_s=5.0)
    dead = _closed_url()
    sender = WeightSender([cut.url, waiting.url, dead], "127.0.0.1", 1, timeout_s=2.0)
    try:
        # engine 0 answers, but its call lost its connection (its server restarted, a proxy
        # dropped it): a real ConnectError against a closed port
        connect_error = _failed_post(_closed_url(), 2.0)
        # engine 1 answers; its call ran out its timeout (a waiting engine's call times out
        # with the frozen one's): a real ReadTimeout
        timed_out = _failed_post(slow.url, 0.3)
        pending: Future = Future()  # engine 2 never answered: dead
        text = sender._not_answered([connect_error, timed_out, pending], ROUTE)
    finally:
        sender._release()
        for engine in (cut, waiting, slow):
            engine.close()
    silent, _, rest = text.partition("does not answer HTTP")
    assert silent.startswith(f"engine 2 ({dead}) did not receive"), text
    assert f"engine 0 ({cut.url}) answers HTTP but its {ROUTE} call failed" in rest, text
    assert "ConnectError" in rest, text
    assert f"engine 1 ({waiting.url}) answer HTTP but did not finish {ROUTE}" in rest, text
