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


def test_dead_roles_come_back_until_the_cap(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    specs = [RoleSpec(name="broker", argv=SLEEP, het_group=0, host="127.0.0.1",
                      restart_argv=[*SLEEP, "--replay"]),
             RoleSpec(name="rollout", argv=SLEEP, het_group=1, host="127.0.0.1")]
    procs = ProcessSet(tmp_path / "logs", dict(os.environ))
    try:
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
    finally:
        procs.close()
