"""Hang detection against a real broker process: a role that stops heartbeating, an engine that
stops answering /server_info and a broker that stops answering /status are each named once they are
silent for the timeout; a role that keeps beating never is."""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections.abc import Callable

import pytest

from relax_slurm.launch.health import HangWatch
from relax_slurm.runtime.ports import free_port
from tests.helpers_broker import SECRET, Broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
# the "not yet" checks poll a third of the timeout: a margin of two thirds (2 s) for a
# heartbeat round trip or a stall of this loaded machine between the test's deadline and the
# watch's own clock (0.5 s of margin once was all there was)
INTERVAL_S, TIMEOUT_S = 0.2, 3.0


def poll(watch: HangWatch, for_s: float, each: Callable[[], None] = lambda: None
         ) -> tuple[str, str] | None:
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        each()
        found = watch.check()
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def test_silent_roles_engines_and_broker_are_named(start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(admin=True)
    with broker.client("trainer") as trainer, broker.client("worker") as worker:
        worker.heartbeat("rollout")
        watch = HangWatch(broker.admin, SECRET, {}, INTERVAL_S, TIMEOUT_S)
        try:
            # the trainer keeps beating; the worker fell silent after one beat
            found = poll(watch, 3 * TIMEOUT_S, lambda: trainer.heartbeat("trainer", step=1))
        finally:
            watch.close()
        assert found is not None and found[0] == "rollout" and "no heartbeat" in found[1]
        # restarted in place: its predecessor's silence is not held against the new process,
        # which is named again only once it too has been silent for the timeout
        # (the trainer keeps beating here too: silent since its last beat of the first poll,
        # it would cross the timeout together with the restarted worker, and either could be
        # named first)
        watch = HangWatch(broker.admin, SECRET, {}, INTERVAL_S, TIMEOUT_S)
        beat = lambda: trainer.heartbeat("trainer", step=1)  # noqa: E731
        try:
            watch.restarted("rollout")
            assert poll(watch, TIMEOUT_S / 3, beat) is None
            found = poll(watch, 2 * TIMEOUT_S, beat)
        finally:
            watch.close()
        assert found is not None and found[0] == "rollout"

    dead_engine = f"http://127.0.0.1:{free_port()}"
    watch = HangWatch(None, SECRET, {"engine1": dead_engine}, INTERVAL_S, TIMEOUT_S)
    try:
        assert poll(watch, TIMEOUT_S / 3) is None  # silent, but not for long enough yet
        assert poll(watch, 2 * TIMEOUT_S) == (
            "engine1", f"has not answered /server_info for {TIMEOUT_S:.0f}s "
            "(cluster.restart.heartbeat_timeout_s)")
    finally:
        watch.close()

    watch = HangWatch(broker.admin, SECRET, {}, INTERVAL_S, TIMEOUT_S)
    off = HangWatch(broker.admin, SECRET, {}, INTERVAL_S, 0)  # 0: hang detection off
    try:
        broker.proc.kill()
        broker.proc.wait(10)
        found = poll(watch, 3 * TIMEOUT_S)
        assert found is not None and found[0] == "broker" and "GET /status" in found[1]
        assert poll(off, 0.5) is None
    finally:
        watch.close()
        off.close()


def ctl_run_dir(broker: Broker, tmp_path) -> Path:
    """A run directory relax-ctl can reach `broker` from: its plan and its secret."""
    from relax_slurm.auth import secret_path
    from relax_slurm.runtime.plan import RunPlan, save_plan

    run = tmp_path / "ctl"
    run.mkdir()
    save_plan(RunPlan(broker_router=broker.router, broker_pub=broker.pub,
                      broker_admin=broker.admin), run)
    secret_path(run).write_text(SECRET + "\n")
    secret_path(run).chmod(0o600)
    return run


def test_relax_ctl_status_reads_plan_and_secret(start_broker: Callable[..., Broker], tmp_path,
                                                 capsys) -> None:
    from relax_slurm.auth import secret_path
    from relax_slurm.launch.ctl import main

    broker = start_broker(admin=True)
    run = ctl_run_dir(broker, tmp_path)
    secret_path(run).write_text("wrong\n")
    secret_path(run).chmod(0o600)
    assert main(["status", str(run)]) == 1 and "HTTP 401" in capsys.readouterr().err
    secret_path(run).write_text(SECRET + "\n")
    assert main(["status", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] == broker.proc.pid


def test_relax_ctl_into_a_closed_pipe_exits_quietly(start_broker: Callable[..., Broker],
                                                   tmp_path) -> None:
    """`relax-ctl status RUN | head`: the reader leaves early; no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    run = ctl_run_dir(start_broker(admin=True), tmp_path)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails
    try:
        proc = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", "status", str(run)],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_hung_engine_is_named_before_the_roles_waiting_on_it(
        start_broker: Callable[..., Broker]) -> None:
    """A trainer blocked in a weight push to a hung engine falls silent with it: the engine is
    the one named (and restarted), and the roles get the timeout anew from its restart."""
    broker = start_broker(admin=True)
    dead_engine = f"http://127.0.0.1:{free_port()}"
    with broker.client("trainer") as trainer:
        trainer.heartbeat("trainer", step=1)  # then silent, as in a push to the engine
        watch = HangWatch(broker.admin, SECRET, {"engine0": dead_engine}, INTERVAL_S, TIMEOUT_S)
        try:
            time.sleep(TIMEOUT_S + 0.5)  # both silent for longer than the timeout
            found = poll(watch, 2 * INTERVAL_S)
            assert found is not None and found[0] == "engine0", found
            watch.restarted("engine0")
            assert poll(watch, TIMEOUT_S / 3) is None
        finally:
            watch.close()


def test_a_role_that_fell_silent_before_a_hung_engine_waits_for_the_engines_verdict(
        start_broker: Callable[..., Broker]) -> None:
    """The trainer's last beat can predate the engine's last /health answer (it went into a
    weight push just before the engine froze; a clean-clone chaos run named the trainer hung
    and failed): while an engine does not answer, the silent role is not named, the engine is
    once silent for the timeout."""
    broker = start_broker(admin=True)
    dead_engine = f"http://127.0.0.1:{free_port()}"
    with broker.client("trainer") as trainer:
        trainer.heartbeat("trainer", step=1)  # then silent, as in a push to the engine
        time.sleep(TIMEOUT_S / 2)  # the trainer's silence starts before the engine's
        watch = HangWatch(broker.admin, SECRET, {"engine0": dead_engine}, INTERVAL_S, TIMEOUT_S)
        try:
            found = poll(watch, 2 * TIMEOUT_S)
        finally:
            watch.close()
        assert found is not None and found[0] == "engine0", found



def test_a_role_restarted_in_place_may_take_the_startup_time_to_answer():
    """rollout.startup_timeout_s (here 100) longer than the hang timeout (10): a restarted
    engine loading its model again is not named until the startup time has passed, and the
    roles waiting on it get as long (a fake clock: no waiting here)."""
    now = [0.0]
    dead = f"http://127.0.0.1:{free_port()}"
    watch = HangWatch(None, SECRET, {"engine1": dead}, 1.0, 10.0, clock=lambda: now[0],
                      startup_s=100.0)
    try:
        watch.restarted("engine1")
        for t in (5.0, 50.0, 99.0):  # silent past the timeout, within the startup time
            now[0] = t
            assert watch.check() is None, t
            assert watch._in_grace("rollout", t)
        now[0] = 111.0
        found = watch.check()
        assert found is not None and found[0] == "engine1", found
        assert not watch._in_grace("rollout", 111.0)
    finally:
        watch.close()
    # without a longer startup time the timeout alone counts, as before
    now[0] = 0.0
    watch = HangWatch(None, SECRET, {"engine1": dead}, 1.0, 10.0, clock=lambda: now[0])
    try:
        watch.restarted("engine1")
        now[0] = 11.0
        assert watch.check() is not None
    finally:
        watch.close()
