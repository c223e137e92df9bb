"""Rank 0 hosts the weight-sync group's store before any engine is told its port
(weightsync/group.py host_store): a planned port another process took in the meantime is never
waited on; the store binds a port of the OS's choosing and says which."""

from __future__ import annotations

import socket

import pytest

from relax_slurm.weightsync.group import host_store

pytestmark = pytest.mark.timeout(60)


def test_a_taken_port_gives_a_store_on_another_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        store = host_store("127.0.0.1", port, world_size=2, group_name="g", timeout_s=5)
        assert store.port not in (port, 0)
        store.set("k", b"v")
        assert store.get("k") == b"v"

