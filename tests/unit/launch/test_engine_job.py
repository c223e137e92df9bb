"""Slurm elastic rollout's engine jobs (launch/engine_job.py): the sbatch script submitit renders
for one (golden), the resources' defaults, the URL file, and the environment sbatch gets.
The real submission is tested on a real Slurm (tests/slurm/test_slurm_elastic.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from submitit.slurm.slurm import _make_sbatch_string

from relax_slurm.launch import engine_job as ej
from relax_slurm.launch.slurm_env import without_job_env
from tests.unit.launch.test_sbatch import check_golden
from tests.unit.launch.test_submit import cfg_for

FOLDER = Path("/runs/x/submitit/engines")
COMMAND = "exec /venv/python -u -m submitit.core._submit /runs/x/submitit/engines"


def script(*overrides: str, name: str = "engine3") -> str:
    params = ej.job_parameters(cfg_for(*overrides), name, Path("/home/me/project"))
    return _make_sbatch_string(command=COMMAND, folder=FOLDER, **params)


def test_engine_job_script_matches_golden():
    text = script("cluster.partition=cpu", "cluster.rollout_partition=gpu", "cluster.account=p1",
                  "cluster.gpus_per_node=8", "rollout.engine=sglang", "rollout.engine_tp_size=2",
                  "cluster.engine_job_cpus=16", "cluster.engine_job_time_min=90",
                  "cluster.engine_job_mem_gb=64", "cluster.job_name=grpo",
                  "cluster.setup_lines=[source venv/bin/activate]")
    check_golden("engine_job.sbatch", text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_engine_job_resources_default_to_the_rollout_component():
    lines = script("cluster.partition=cpu", "cluster.cpus_per_task=6",
                   "cluster.time_limit_min=45").splitlines()
    for want in ("--partition=cpu", "--cpus-per-task=6", "--time=45", "--nodes=1",
                 "--job-name=relax-engine3", "--no-requeue"):
        assert f"#SBATCH {want}" in lines, want
    assert not any("gpus" in l or "--mem" in l for l in lines)  # CPU run: none asked
    assert "srun" not in "\n".join(lines)  # the function runs in the batch step
    engine_partition = script("cluster.partition=cpu", "cluster.engine_job_partition=spot")
    assert "#SBATCH --partition=spot" in engine_partition.splitlines()


def test_url_file_is_read_for_its_own_job_only(tmp_path):
    assert ej.read_url(tmp_path, "engine1", "7") is None
    ej.write_url_file(tmp_path, "engine1", {"url": "http://n1:5", "job_id": "7"})
    assert ej.read_url(tmp_path, "engine1", "7") == "http://n1:5"
    assert ej.read_url(tmp_path, "engine1", "8") is None  # left by an earlier job
    assert not list((tmp_path / "engines").glob("*.tmp"))


def test_sbatch_inside_a_job_gets_no_job_variables():
    env = {"SLURM_JOB_ID": "5", "SLURM_CPUS_PER_TASK": "4", "SLURM_CONF": "/etc/s.conf",
           "PATH": "/bin", "SBATCH_ACCOUNT": "p1"}
    assert without_job_env(env) == {"SLURM_CONF": "/etc/s.conf", "PATH": "/bin",
                                     "SBATCH_ACCOUNT": "p1"}
