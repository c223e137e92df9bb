"""runtime.plan: the ports the launcher hands out, and the roles a local plan holds."""

import socket

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.runtime.plan import _ephemeral_range, free_port


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
