"""The reward tests' fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.helpers_http import Reply, Server


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], Server]]:
    """serve(reply) starts a server answering with reply(path, body); all stop at the end."""
    servers: list[Server] = []

    def start(reply: Reply) -> Server:
        servers.append(Server(reply))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
