"""`relax-ctl dump` on a live run of the real topology (relax-train experiment=tiny_cpu, one
trainer rank): one stack file per role, each holding frames of that role's own code; then a
burst of dumps of every role while it trains (the trainer starts and ends threads every step:
faulthandler's handler, the earlier design, killed a rank that way); then the run is ended
with a stop request (as test_stop_e2e.py does) and finishes as usual: the signals stopped
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_slurm.runtime.control import request_stop
from relax_slurm.runtime.stacks import DUMP_SIGNAL, registrations
from tests.conftest import ONE_RANK, REPO, run_env
from tests.integration.test_chaos import finish, start, stop, wait_steps

TOTAL = 1000
BURST = 60  # dumps of every role, one at a time; the old handler died within ~30 of a churn
BURST_WAIT_S = 60.0  # for each round's dumps: generous for a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# a frame of each role's own module (the dump writes `File "PATH", line N in FUNC`)
OWN_CODE = {"broker": "relax_slurm/broker/", "engine0": "relax_slurm/engines/hf/",
            "rollout": "relax_slurm/rollout/", "trainer-rank0": "relax_slurm/trainer/",
            "trainer-agent": "torch/distributed/"}


def test_relax_ctl_dump_writes_every_roles_stacks_of_a_live_run(tmp_path, tiny_assets):
    run_dir = tmp_path / "run"
    proc = start(run_dir, tiny_assets, ONE_RANK, f"trainer.total_steps={TOTAL}")
    try:
        wait_steps(proc, run_dir, 2)  # every role is up (and registered) once steps are made
        # relax-ctl status adds, in words, what the trainer waits on (launch/waiting.py)
        st = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", "status",
                             str(run_dir)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=run_env())
        assert st.returncode == 0, st.stderr
        waiting = json.loads(st.stdout)["waiting"]
        assert waiting.startswith("the trainer "), waiting
        ctl = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", "dump",
                              str(run_dir), "--wait-s", "60"],
                             cwd=REPO, capture_output=True, text=True, timeout=180, env=run_env())
        assert ctl.returncode == 0, ctl.stderr
        burst_of_dumps(run_dir, proc)
        request_stop(run_dir, "dumped")
    except BaseException:
        stop(proc)  # the launcher and every role
        raise
    finish(proc)  # the run ends as finished: the dump disturbed nothing
    reply = json.loads(ctl.stdout)
    assert reply["answered"] == sorted(OWN_CODE), reply
    assert reply["did_not_answer"] == [] and reply["not_registered"] == [], reply
    folder = Path(reply["folder"])
    assert folder.parent == run_dir / "diagnostics"
    for name, own in OWN_CODE.items():
        text = (folder / f"{name}.txt").read_text()
        assert "Main thread 0x" in text and own in text, (name, text[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"]["reason"] == "dumped" and summary["samples_lost"] == 0


def dumps_in(path: Path) -> int:
    return path.read_text(errors="replace").count("# dump at")


def burst_of_dumps(run_dir: Path, proc: subprocess.Popen) -> None:
    """BURST rounds: every registered role signalled once, then waited for until each wrote
    that dump (signals sent while one is pending would merge into one)."""
    regs = registrations(run_dir)
    assert len(regs) == len(OWN_CODE), regs  # every role (the engine as engine-<port>)
    for n in range(1, BURST + 1):
        before = {r.pid: dumps_in(r.path) for r in regs}
        for r in regs:
            os.kill(r.pid, DUMP_SIGNAL)
        deadline = time.monotonic() + BURST_WAIT_S
        while any(dumps_in(r.path) <= before[r.pid] for r in regs):
            assert proc.poll() is None, f"the run ended during dump round {n}"
            assert time.monotonic() < deadline, f"dump round {n} not written in {BURST_WAIT_S}s"
            time.sleep(0.02)
