"""launch.plan: the ports the launcher hands out."""

import socket

from relax_slurm.launch.plan import _ephemeral_range, free_port


def test_free_ports_avoid_the_ephemeral_range_and_are_bindable():
    lo, hi = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # chosen at random, not one fixed port
    for port in ports:
        # outgoing connections take ports in [lo, hi]: a port handed out there can be gone
        # before the role binds it
        assert 10000 <= port < lo or lo <= 12000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # a connection's own port is in the ephemeral range, never one of ours
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        client.connect(server.getsockname())
        assert lo <= client.getsockname()[1] <= hi


def test_one_process_never_hands_out_a_port_twice():
    # a plan asks for every port before any role binds one: "free now" alone gave two roles of
    # one run the same port (an engine then failed to bind). 3000 draws from ~22k ports repeat
    # one almost surely (birthday bound) unless handed-out ports are remembered.
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)
