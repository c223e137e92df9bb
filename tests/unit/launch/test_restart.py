"""Restarts in place with real processes: a dead role with a restart command comes back (new
pid, same log, a restarts.jsonl line, roles.json rewritten) until its cap; a role without one,
or past the cap, is reported dead as before."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from relax_slurm.errors import RoleFailed
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.launch.restart import InPlace, write_roles
from relax_slurm.launch.roles import RoleSpec

pytestmark = pytest.mark.timeout(60)
SLEEP = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def two_roles(restartable: str, flag: str, plain: str) -> list[RoleSpec]:
    """A role restarted with SLEEP + [flag], and one without a restart command."""
    return [RoleSpec(name=restartable, argv=SLEEP, het_group=0, host="127.0.0.1",
                     restart_argv=[*SLEEP, flag]),
            RoleSpec(name=plain, argv=SLEEP, het_group=1, host="127.0.0.1")]


@pytest.fixture
def procs(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    procs = ProcessSet(tmp_path / "logs", dict(os.environ))
    yield procs
    procs.close()


def test_dead_roles_come_back_until_the_cap(tmp_path: Path, procs: ProcessSet) -> None:
    specs = two_roles("broker", "--replay", "rollout")
    roles = {s.name: procs.start(s.name, s.argv) for s in specs}
    write_roles(procs, tmp_path)
    in_place = InPlace(procs, specs, wrap=lambda spec: spec.argv, run_dir=tmp_path, cap=1)
    first = roles["broker"].proc.pid
    os.kill(first, signal.SIGKILL)
    roles["broker"].proc.wait(10)
    in_place.revive()
    procs.check_alive()  # back: nothing to report
    assert roles["broker"].proc.pid != first and roles["broker"].proc.args[-1] == "--replay"
    info = {r["name"]: r for r in json.loads((tmp_path / "roles.json").read_text())}
    assert info["broker"]["pid"] == roles["broker"].proc.pid
    assert info["broker"]["restarts"] == 1
    rows = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert rows[0]["role"] == "broker" and rows[0]["kind"] == "in_place"
    assert rows[0]["cause"] == "exited with code -9"
    assert "restarting broker in place" in (tmp_path / "logs" / "broker.log").read_text()
    assert in_place.counts() == {"broker": 1}

    roles["broker"].proc.kill()  # past the cap: reported like any death
    roles["broker"].proc.wait(10)
    in_place.revive()
    with pytest.raises(RoleFailed, match="role 'broker' exited"):
        procs.check_alive()
    rollout = roles["rollout"].proc
    rollout.kill()
    rollout.wait(10)
    in_place.revive()  # no restart command: left dead
    assert roles["rollout"].proc is rollout and in_place.counts() == {"broker": 1}


def test_a_hung_role_is_killed_and_started_again(tmp_path: Path, procs: ProcessSet) -> None:
    """A role alive but silent (health.py names it, by a heartbeat name such as rollout0) is
    SIGKILLed and started again like a dead one; one without a restart command is not."""
    specs = two_roles("rollout", "--rejoin", "trainer")
    roles = {s.name: procs.start(s.name, s.argv) for s in specs}
    restarted = []
    in_place = InPlace(procs, specs, wrap=lambda spec: spec.argv, run_dir=tmp_path, cap=1,
                       on_restart=restarted.append)
    frozen = roles["rollout"].proc
    os.kill(frozen.pid, signal.SIGSTOP)
    assert in_place.restart_hung("rollout0", "sent no heartbeat for 30s")
    assert frozen.poll() == -signal.SIGKILL  # killed, stopped or not
    assert roles["rollout"].proc.pid != frozen.pid and roles["rollout"].proc.poll() is None
    assert roles["rollout"].proc.args[-1] == "--rejoin" and restarted == ["rollout"]
    rows = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert rows == [{**rows[0], "role": "rollout", "kind": "in_place", "restart": 1,
                     "cause": "hung: sent no heartbeat for 30s"}]
    assert not in_place.restart_hung("rollout", "again")  # past the cap
    assert not in_place.restart_hung("trainer", "sent no heartbeat")  # no restart command
    assert roles["trainer"].proc.poll() is None  # left alone: the caller fails the attempt


def test_a_role_dying_after_revive_is_left_for_the_next_tick(tmp_path: Path,
                                                             procs: ProcessSet) -> None:
    """The supervisor polls `revive` then `check_alive`: a restartable role that dies between
    the two (CI saw an engine SIGKILLed there fail the run) is skipped by `check_alive` and
    restarted by the next `revive`; past its cap it is reported."""
    specs = two_roles("engine0", "--again", "trainer")
    roles = {s.name: procs.start(s.name, s.argv) for s in specs}
    in_place = InPlace(procs, specs, wrap=lambda spec: spec.argv, run_dir=tmp_path, cap=1)
    in_place.revive()  # all alive: nothing to do
    first = roles["engine0"].proc
    first.kill()
    first.wait(10)
    assert in_place.revivable() == ("engine0",)
    procs.check_alive(skip=in_place.revivable())  # the dead engine is the next tick's
    in_place.revive()
    assert roles["engine0"].proc is not first and roles["engine0"].proc.poll() is None
    roles["engine0"].proc.kill()
    roles["engine0"].proc.wait(10)
    assert in_place.revivable() == ()  # past the cap: check_alive reports it
    with pytest.raises(RoleFailed, match="role 'engine0' exited"):
        procs.check_alive(skip=in_place.revivable())
