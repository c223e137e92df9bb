"""Slurm elastic rollout's engine jobs (launch/engine_job.py): the sbatch script submitit renders
for one (golden), the resources' defaults, the URL file, the environment sbatch gets, and the
job's function run as a process (restart in place, stop). The real submission is tested on a
real Slurm (tests/slurm/test_slurm_elastic.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from relax_slurm.auth import ensure_secret
from relax_slurm.config import save_config
from relax_slurm.config.cluster import SlurmClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.launch import engine_job as ej
from relax_slurm.launch.slurm_env import without_job_env
from tests.conftest import REPO
from tests.helpers_tiny import wait_healthy
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
                  "cluster.elastic.job_cpus=16", "cluster.elastic.job_time_min=90",
                  "cluster.elastic.job_mem_gb=64", "cluster.job_name=grpo",
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
    engine_partition = script("cluster.partition=cpu", "cluster.elastic.job_partition=spot")
    assert "#SBATCH --partition=spot" in engine_partition.splitlines()


def test_the_engine_runs_in_the_runs_container():
    argv = [sys.executable, "-m", "relax_slurm.engines.hf", "--port", "5"]
    assert ej.job_argv(cfg_for(), "engine3", argv, "/w") == argv  # no container
    pyxis = ej.job_argv(cfg_for("cluster.container.image=img.sqsh", "cluster.container.python=py3",
                                "cluster.container.mounts=[/data:/data]",
                                "cluster.extra_srun_args=[--overlap]"), "engine3", argv, "/w")
    # a step of the engine job, in the image, with the container's Python
    assert pyxis == ["srun", "--nodes=1", "--ntasks=1", "--job-name=engine3",
                     "--kill-on-bad-exit=1", "--container-image=img.sqsh",
                     f"--container-name=relax_{hashlib.sha1(b'img.sqsh').hexdigest()[:12]}",
                     "--container-workdir=/w", "--container-mounts=/data:/data", "--overlap",
                     "py3", *argv[1:]]
    apptainer = ej.job_argv(cfg_for("cluster.container.prefix=[apptainer,exec,--nv,img.sif]"),
                            "engine3", argv, "/w")
    assert apptainer == ["apptainer", "exec", "--nv", "img.sif", "python", *argv[1:]]


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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_job_function_serves_restarts_in_place_and_stops(tmp_path, tiny_assets):
    """`serve` as the engine job runs it (in a process of its own, with the variables Slurm
    sets; no Slurm here, so squeue fails and the run's job counts as queued): it reports its
    URL, restarts a SIGKILLed engine on the same URL, and a SIGTERM (scancel) stops it all.
    Its engine runs through the run's container prefix (here `env`, which marks it)."""
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path=str(tiny_assets / "model")),
                      data=DataConfig(train_files=["x"]),
                      cluster=SlurmClusterConfig())  # engine jobs (and containers) are Slurm's
    cfg.cluster.container.prefix = ["env", "RELAX_TEST_CONTAINER=1"]
    cfg.cluster.container.python = sys.executable
    save_config(cfg, tmp_path / "config.yaml")
    ensure_secret(tmp_path)
    (tmp_path / "logs").mkdir()
    # (a session that ran the slurm tests has SLURM_CONF set: squeue must not reach that
    # cluster, where job 5 has long ended)
    env = {**without_job_env(os.environ), "PYTHONPATH": str(REPO), "SLURMD_NODENAME": "127.0.0.1",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_CONF": "/nonexistent"}
    code = ("import sys; from relax_slurm.launch.engine_job import serve; "
            f"sys.exit(serve({str(tmp_path)!r}, 'engine1', 3, '5'))")
    job = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    log = tmp_path / "logs" / "engine1.log"
    try:
        deadline = time.monotonic() + 120
        while ej.read_url(tmp_path, "engine1", "7") is None:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.2)
        url = ej.read_url(tmp_path, "engine1", "7")
        wait_healthy(url, job, 120, log)
        first = json.loads(ej.url_file(tmp_path, "engine1").read_text())["pid"]
        assert b"RELAX_TEST_CONTAINER=1" in Path(f"/proc/{first}/environ").read_bytes()
        os.kill(first, signal.SIGKILL)
        while json.loads(ej.url_file(tmp_path, "engine1").read_text())["pid"] == first:
            assert job.poll() is None and time.monotonic() < deadline + 60, job.communicate()
            time.sleep(0.2)
        info = json.loads(ej.url_file(tmp_path, "engine1").read_text())
        assert info["url"] == url and info["restarts"] == 1
        wait_healthy(url, job, 120, log)  # the same URL serves again
        job.send_signal(signal.SIGTERM)  # scancel
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        for pid in (json.loads(ej.url_file(tmp_path, "engine1").read_text())["pid"],):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert "engine1 exited with code -9; restarted in place (1 of" in out, out
    with pytest.raises(ProcessLookupError):  # the engine went with the job
        os.kill(info["pid"], 0)
    assert "restarting engine1 in place" in log.read_text()
