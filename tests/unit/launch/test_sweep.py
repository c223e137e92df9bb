"""`relax-train -m`: point directories named by the swept keys, and a Slurm sweep's dry run
(one job per point, each in its own directory; the real relax-train, nothing submitted)."""

from __future__ import annotations

import json
import subprocess
import sys

from relax_slurm.launch.sweep import Point, Sweep, fixed_keys, point_name
from tests.conftest import REPO, run_env


def test_point_name_keeps_values_and_flattens_paths():
    assert point_name(0, "trainer.lr=1e-05") == "0_trainer.lr=1e-05"
    assert point_name(3, "model.path=/m/a,seed=1") == "3_model.path=_m_a,seed=1"
    assert point_name(2, "") == "2"  # a multirun that sweeps nothing
    assert len(point_name(1, "k=" + "v" * 500)) < 130


def test_fixed_keys_are_the_ones_with_one_value():
    argv = ["-m", "experiment=tiny_cpu", "run_dir=runs/s", "trainer.lr=1e-5,2e-5",
            "seed=range(0,3)", "+extra=1", "hydra.verbose=true"]
    assert fixed_keys(argv) == ["experiment", "extra", "run_dir"]


def test_table_and_exit_code(tmp_path):
    done = tmp_path / "0_seed=0"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"reward_first": 0.0125, "reward_last": 0.85}))
    sweep = Sweep()
    sweep.points = [Point(0, "seed=0", str(done), "completed"),
                    Point(1, "seed=1", "/r/1_seed=1", "failed",
                          message="trainer.lr=-1.0: must be > 0")]
    table = sweep.table()
    header, first, second = table.splitlines()[:3]
    assert header.split()[-1] == "reward" and first.endswith("completed  0.013 -> 0.850")
    assert second.split()[-1] == "-"  # failed: no summary
    assert "1_seed=1" in table and "failed" in table and "trainer.lr=-1.0" in table
    assert "2 point(s), 1 failed" in table
    assert sweep.exit_code() == 1
    sweep.points.pop()
    assert sweep.exit_code() == 0


def relax_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", *args], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=300)


def test_slurm_dry_run_sweep_renders_one_job_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    proc = relax_train("-m", "experiment=tiny_cpu", f"run_dir={sweep}", "cluster=slurm",
                       "cluster.dry_run=true", "rollout.num_engines=1,2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dirs = [sweep / "0_rollout.num_engines=1", sweep / "1_rollout.num_engines=2"]
    scripts = proc.stdout.split("#!/bin/bash")[1:]
    assert len(scripts) == 2
    for d, script, engines in zip(dirs, scripts, (1, 2)):
        assert d.is_dir()  # Hydra's output directory of the point: its run_dir
        assert f"--run-dir {d}\n" in script
        assert "#SBATCH hetjob" in script
        # the point's own value reached its job: one engine step per engine
        assert script.count("--job-name=engine") == engines
    points = json.loads((sweep / "sweep.json").read_text())
    assert [(p["run_dir"], p["state"]) for p in points] == [(str(d), "dry run") for d in dirs]


def test_run_dir_cannot_be_swept(tmp_path):
    proc = relax_train("-m", "experiment=tiny_cpu", f"run_dir={tmp_path}/a,{tmp_path}/b",
                       "cluster=slurm", "cluster.dry_run=true")
    assert proc.returncode == 1
    assert "run_dir cannot be swept" in proc.stderr


def test_a_single_run_is_unchanged(tmp_path):
    proc = relax_train("experiment=tiny_cpu", "cluster=slurm", "cluster.dry_run=true",
                       f"run_dir={tmp_path}/one")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--run-dir {tmp_path}/one\n" in proc.stdout
    assert "point(s)" not in proc.stdout
