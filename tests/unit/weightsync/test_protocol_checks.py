"""What trainer rank 0 does with a server outside the protocol, before any weight moves: an
SGLang release outside the supported range is refused when the cohort forms, naming the
range; a server without /model_info is an error, never taken for an engine being restarted.
The servers here answer like those releases do (SGLang itself does not run on CPU): /server_info
with their version, a 404 for routes they lack."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from relax_slurm.errors import EngineError, WeightSyncError
from relax_slurm.weightsync import WeightSender
from relax_slurm.weightsync.cohort import Cohort


@contextlib.contextmanager
def server(version: str) -> Iterator[str]:
    """An HTTP server whose /server_info reports SGLang `version`; every other route 404s."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            body = json.dumps({"version": version}).encode()
            self.send_response(200 if self.path in ("/server_info", "/health") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def sender(urls: list[str], mode: str = "retract") -> WeightSender:
    return WeightSender(urls, "127.0.0.1", 1, "g", "gloo", 10, 1, pause_mode=mode)


def test_an_sglang_outside_the_range_is_refused_before_the_group_forms():
    with server("0.5.20") as url:
        s = sender([url])
        with pytest.raises(WeightSyncError, match=r"runs SGLang 0\.5\.20; relax-slurm speaks "
                                                  r"SGLang >=0\.5\.21,<0\.5\.24") as e:
            s.connect()  # port 1: had it tried to form the group, this would hang, not raise
        assert url in str(e.value)
        s.close()


def test_a_pause_mode_the_release_cannot_flush_with_is_refused_naming_the_key():
    with server("0.5.22") as url:
        assert sender([url], "abort").check_engines()[0].version == "0.5.22"
        with pytest.raises(WeightSyncError, match=r"weight_sync\.pause_mode=in_place: SGLang "
                                                  r"0\.5\.22 cannot flush"):
            sender([url], "in_place").check_engines()


def test_a_missing_model_info_is_an_error_not_an_engine_being_restarted():
    with server("0.5.22") as url:
        cohort = Cohort([url], "g", 1, lambda name, port, urls: sender(urls), lambda: 2, 10)
        with pytest.raises(EngineError, match="/model_info nor /get_model_info"):
            cohort.stale(3)  # None ("try later") would never re-sync this engine
        cohort.close()
