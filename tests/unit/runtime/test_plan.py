"""runtime.plan and runtime.ports: the ports the launcher hands out, and the roles a local plan
holds."""

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.runtime import ports
from relax_slurm.runtime.ports import ephemeral_range, free_port


def test_free_ports_avoid_the_ephemeral_range_and_are_bindable():
    lo, hi = ephemeral_range()
    drawn = {free_port() for _ in range(20)}
    assert len(drawn) > 1  # chosen at random, not one fixed port
    for port in drawn:
        # outgoing connections take ports in [lo, hi]: a port handed out there can be gone
        # before the role binds it
        assert 10000 <= port < lo or lo <= 12000
        # nor SGLang's own draw for its scheduler's port (0.5.22+: 22000-29999), bound while
        # our engine's HTTP port is not yet
        assert port < ports.SGLANG_LOW or lo <= 12000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # a connection's own port is in the ephemeral range, never one of ours
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        client.connect(server.getsockname())
        assert lo <= client.getsockname()[1] <= hi


def test_one_process_never_hands_out_a_port_twice(tmp_path, monkeypatch):
    # a plan asks for every port before any role binds one: "free now" alone gave two roles of
    # one run the same port (an engine then failed to bind). 3000 draws from 12k ports repeat
    # one almost surely (birthday bound) unless handed-out ports are remembered: here by the
    # process alone (the host's file cannot be opened)
    monkeypatch.setenv(ports.PORTS_FILE_ENV, str(tmp_path / "no such dir" / "ports"))
    drawn = [free_port() for _ in range(3000)]
    assert len(set(drawn)) == len(drawn)


DRAW = """
import json, sys
from relax_slurm.runtime import ports
ports.SGLANG_LOW = ports.LOW + 2000  # a narrow range: unremembered draws would repeat
print(json.dumps([ports.free_port() for _ in range(int(sys.argv[1]))]))
"""


def draw_in_processes(files: list, n: int) -> list[set[int]]:
    procs = [subprocess.Popen([sys.executable, "-c", DRAW, str(n)], stdout=subprocess.PIPE,
                              env={**os.environ, ports.PORTS_FILE_ENV: str(f)})
             for f in files]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [set(json.loads(o)) for o in outs]


def test_two_processes_on_one_host_never_hand_out_the_same_port(tmp_path):
    # another run's launcher, the other test worker: each chooses "free now" too, and the port
    # one chose is not bound until its role has started (an SGLang server: tens of seconds).
    # 2 x 400 draws from 2000 ports share ~80 (400 * 400 / 2000) unless the host remembers
    # them; the control, each process with a file of its own, shows the overlap the shared
    # file prevents
    a, b = draw_in_processes([tmp_path / "ports"] * 2, 400)
    assert len(a) == len(b) == 400 and not a & b
    c, d = draw_in_processes([tmp_path / "c", tmp_path / "d"], 400)
    assert c & d
    # the file holds every hand-out, each for RESERVE_S
    held = dict(line.split() for line in (tmp_path / "ports").read_text().splitlines())
    assert set(map(int, held)) == a | b


def test_a_reservation_expires(tmp_path, monkeypatch):
    path = tmp_path / "ports"
    old, recent = time.time() - ports.RESERVE_S - 1, time.time()
    path.write_text(f"12345 {old}\n12346 {recent}\nnot a line\n")
    monkeypatch.setenv(ports.PORTS_FILE_ENV, str(path))
    port = free_port()
    held = dict(line.split() for line in path.read_text().splitlines())
    assert set(held) == {"12346", str(port)}  # the expired one and the torn line are gone


def test_a_host_file_that_cannot_be_written_back_still_hands_out_ports(tmp_path, monkeypatch):
    """A full disk at the write-back costs the host-wide record, not the run: the port is
    handed out (and this process still never repeats it)."""
    monkeypatch.setenv(ports.PORTS_FILE_ENV, str(tmp_path / "ports"))

    class Full(io.TextIOWrapper):
        def write(self, text):
            raise OSError(28, "No space left on device")

    real_open = open
    monkeypatch.setattr(ports, "open", lambda path, mode: Full(real_open(path, mode + "b")),
                        raising=False)
    got = [ports.free_port() for _ in range(5)]
    lo, hi = ports.draw_range()
    assert len(set(got)) == 5 and all(lo <= p < hi for p in got)
    assert (tmp_path / "ports").read_text() == ""  # nothing written back


def test_a_local_run_plans_and_specs_the_managed_judge(tmp_path):
    from relax_slurm.launch.inputs import check_judge
    from relax_slurm.launch.local import local_plan
    from relax_slurm.launch.roles import engine_specs, genrm_specs
    from relax_slurm.launch.submit import compose_config

    judge = tmp_path / "judge"
    cfg = compose_config(["experiment=tiny_cpu", f"run_dir={tmp_path / 'run'}",
                          "reward.name=genrm", f"reward.genrm_model_path={judge}"])
    with pytest.raises(ConfigError, match=f"reward.genrm_model_path={judge}: no config.json"):
        check_judge(cfg)
    plan = local_plan(cfg)
    assert plan.genrm_url and plan.genrm_url not in plan.engine_urls
    [spec] = genrm_specs(cfg, plan)
    assert spec.name == "genrm" and spec.health_url == plan.genrm_url
    assert spec.restart_argv == spec.argv  # restarted in place, whatever the trainer strategy
    assert spec.argv[spec.argv.index("--model-path") + 1] == str(judge)
    assert "--enable-return-routed-experts" not in spec.argv
    assert [s.name for s in engine_specs(cfg, plan)] == ["engine0"]
    cfg.reward.genrm_model_path = None
    assert local_plan(cfg).genrm_url is None and genrm_specs(cfg, local_plan(cfg)) == []


def test_the_weight_sync_master_is_addressed_on_the_engines_network():
    """Trainer rank 0 tells engines to connect back to its address on the interface that
    routes to them, not whatever its hostname resolves to (issue #34)."""
    import socket

    from relax_slurm.runtime.plan import address_toward

    assert address_toward(["http://127.0.0.1:15000"]) == "127.0.0.1"
    assert address_toward([]) == socket.gethostname()
    # this machine's own non-loopback address, as an engine on another node would see it
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
            ours = s.getsockname()[0]
        except OSError:
            ours = None
    if ours and not ours.startswith("127."):
        assert address_toward([f"http://{ours}:15000", "http://127.0.0.1:1"]) == ours
