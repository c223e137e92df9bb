"""The broker's admin HTTP: `GET /status`, the run as the broker sees it, for operators and the
launcher's hang detection.

    curl -H "Authorization: Bearer $(cat RUN_DIR/secret)" http://HOST:PORT/status

A stdlib `ThreadingHTTPServer` in a daemon thread beside the broker's ZMQ loop: it never touches
the loop's sockets, and it reads the broker's state through `status()`, which takes the same
lock the loop holds while it handles a request (so a reply is one consistent snapshot). Every
request needs the run's secret as a Bearer token (401 and `auth_refused` + 1 otherwise); unknown
paths are 404, other methods 405. Each request has a socket timeout, so a client that stops
sending cannot hold a handler thread for good.

`/rollout/...` (elastic rollout: scale_out, scale_in, engines, ...) goes to `route(method, path,
body)`, the broker's `rollout_route` (JSON bodies of at most MAX_BODY_BYTES; 400 otherwise; a
GET's query parameters, e.g. `?status=ACTIVE`, as the body).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

from relax_slurm.auth import bearer_matches
from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.errors import BrokerError

REQUEST_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 1 << 16
Route = Callable[[str, str, dict[str, Any]], tuple[int, dict[str, Any]]]


def _no_rollout(method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 404, {"error": f"no route {path}; try GET /status"}


class AdminServer:
    def __init__(self, host: str, port: int, secret: str,
                 status: Callable[[], BrokerStatus], on_refused: Callable[[], None],
                 route: Route = _no_rollout) -> None:
        handler = _handler(secret, status, on_refused, route)
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise BrokerError(f"cannot bind the broker's admin HTTP on {host}:{port}: {e}; pick "
                              "a free port or another host address") from e
        self._httpd.daemon_threads = True
        self.host, self.port = host, int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={
            "poll_interval": 0.2}, name="broker-admin", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()


class _BadBody(ValueError):
    """A POST body the admin routes refuse (400)."""


def _json_body(content_length: str | None, rfile: Any) -> dict[str, Any]:
    """A POST's JSON object, at most MAX_BODY_BYTES; _BadBody otherwise."""
    try:
        n = int(content_length or 0)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_BODY_BYTES:
        raise _BadBody(f"Content-Length must be 0..{MAX_BODY_BYTES}")
    try:
        body = json.loads(rfile.read(n) or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise _BadBody(f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise _BadBody("the body must be a JSON object")
    return body


def _handler(secret: str, status: Callable[[], BrokerStatus],
             on_refused: Callable[[], None], route: Route) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # socket timeout of each connection

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if bearer_matches(secret, self.headers.get("Authorization")):
                return True
            on_refused()
            self._send(401, {"error": "missing or wrong token: send Authorization: Bearer "
                                      "$(cat RUN_DIR/secret)"})
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not self._authorized():
                return
            path, _, query = self.path.partition("?")
            path = path.rstrip("/")
            if path.startswith("/rollout/"):  # a GET's filters come as the route's body
                self._send(*route("GET", path, dict(parse_qsl(query))))
            elif path != "/status":
                self._send(404, {"error": f"no route {self.path}; try GET /status"})
            else:
                self._send(200, status().to_dict())

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            path = self.path.split("?")[0].rstrip("/")
            if not path.startswith("/rollout/"):
                self._send(405, {"error": f"POST not allowed on {path}; try GET /status"})
                return
            try:
                body = _json_body(self.headers.get("Content-Length"), self.rfile)
            except _BadBody as e:
                self._send(400, {"error": str(e)})
                return
            self._send(*route("POST", path, body))

        def _not_allowed(self) -> None:
            if self._authorized():
                self._send(405, {"error": f"{self.command} not allowed; try GET /status"})

        do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # the broker's log is for the run, not for each probe

    return Handler
