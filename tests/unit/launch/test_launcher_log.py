"""RUN_DIR/launcher.log: relax-train's own output kept with a local run."""

from __future__ import annotations

import subprocess
import sys

from relax_slurm.launch.launcher_log import tee_output
from tests.conftest import REPO, run_env


def test_the_log_gets_every_line_but_not_the_bars_redraws(tmp_path, capsys):
    log = tmp_path / "run" / "launcher.log"
    with tee_output(log):
        print("step 2/2 reward=0.50")
        print("resume with: relax-train run_dir=x", file=sys.stderr)
        sys.stderr.write("\rtrain:  50%|#####     | 1/2")  # tqdm redrawing its bar
        assert sys.stdout.isatty() is False  # the real stream answers (pytest captures it)
    out = capsys.readouterr()
    assert "step 2/2" in out.out and "resume with:" in out.err and "\rtrain" in out.err
    assert log.read_text() == "step 2/2 reward=0.50\nresume with: relax-train run_dir=x\n"
    print("after")  # the block restored the real streams
    assert log.read_text().count("\n") == 2


def test_a_refused_local_run_leaves_no_directory_for_its_log(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
                        f"run_dir={run_dir}", f"model.path={tmp_path / 'no_model'}"],
                       cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no config.json there" in r.stderr, r.stderr
    assert not run_dir.exists()
