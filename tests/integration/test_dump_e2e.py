"""`relax-ctl dump` on a live run of the real topology (relax-train experiment=tiny_cpu, one
trainer rank): one stack file per role, each holding frames of that role's own code, then the
run is ended with a stop request (as test_stop_e2e.py does) and finishes as usual: the
signal stopped nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_slurm.runtime.control import request_stop
from tests.conftest import ONE_RANK, REPO, run_env
from tests.integration.test_chaos import finish, start, stop, wait_steps

TOTAL = 1000
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
