"""A real HTTP server of the test's own on a free local port: what the remote and genrm
rewards talk to in the unit tests (`serve` is the fixture, tests/unit/rewards/conftest.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# handler(path, body) -> (status, json answer); may sleep
Reply = Callable[[str, dict], tuple[int, object]]


class Server:
    def __init__(self, reply: Reply, port: int = 0) -> None:
        self.reply, self.requests = reply, []
        self.auth: list[str | None] = []  # each request's Authorization header
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                outer.auth.append(self.headers.get("Authorization"))
                status, answer = outer.reply(self.path, body)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass

            def log_message(self, *args: object) -> None:
                pass

        # the OS picks the port unless one is given
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def judge_engine(answer: str) -> Reply:
    """A fake engine: /generate with text input, answering in SGLang's shape."""

    def reply(path: str, body: dict) -> tuple[int, object]:
        if path != "/generate" or not isinstance(body.get("text"), str):
            return 400, {"error": {"message": "send text"}}
        return 200, {"text": answer, "meta_info": {"finish_reason": {"type": "stop"}}}

    return reply
