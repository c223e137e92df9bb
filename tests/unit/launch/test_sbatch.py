"""sbatch rendering: golden files for the rendered scripts and the ready scripts in sbatch/.

Regenerate after an intended change with
    RELAX_UPDATE_GOLDEN=1 python -m pytest tests/unit/launch/test_sbatch.py
(and `python -m relax_slurm.launch.sbatch --write-presets sbatch` for sbatch/), then read the diff.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from relax_slurm.config.cluster import SlurmClusterConfig
from relax_slurm.launch import sbatch
from relax_slurm.launch.submit import compose_config
from tests.conftest import REPO

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR, WORKDIR = Path("/scratch/runs/demo"), Path("/home/me/project")
UPDATE = os.environ.get("RELAX_UPDATE_GOLDEN") == "1"

CASES = {
    "hetjob": [],
    "colocated": ["cluster.layout=colocated", "cluster.rollout_nodes=0", "cluster.mem_gb=64"],
    "multinode": ["cluster.trainer_nodes=2", "cluster.rollout_nodes=2", "cluster.gpus_per_node=8",
                  "trainer.nproc_per_node=8", "rollout.num_engines=4", "cluster.partition=gpu",
                  "cluster.rollout_partition=gpu-inference", "cluster.account=proj42",
                  "cluster.qos=high", "cluster.time_limit_min=1440", "cluster.mem_gb=0",
                  "cluster.signal_lead_s=300", "cluster.preempt_timeout_s=200",
                  "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'",
                  "cluster.container.mounts=[/scratch:/scratch,/home/me:/home/me]",
                  "cluster.extra_sbatch_args=[--exclusive]",
                  "cluster.extra_srun_args=['--cpu-bind=none']",
                  "cluster.setup_lines=[module load cuda/12.4,source .venv/bin/activate]"],
}


def cfg_for(overrides: list[str]):
    cfg = compose_config(["experiment=tiny_cpu", "cluster=slurm", f"run_dir={RUN_DIR}",
                          "cluster.python=/opt/venv/bin/python", *overrides])
    cfg.model.path = "/models/tiny"
    return cfg


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.is_file(), f"{path} missing: run with RELAX_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), f"{name} changed; see the module docstring to update"


@pytest.mark.parametrize("case", CASES)
def test_rendered_script_matches_golden(case):
    text = sbatch.render_script(cfg_for(CASES[case]), RUN_DIR, WORKDIR)
    check_golden(f"{case}.sbatch", text)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_a_run_dir_with_a_space_is_quoted_in_output_too():
    run_dir = Path("/scratch/my runs/demo")
    cfg = cfg_for([])
    cfg.run_dir = str(run_dir)
    text = sbatch.render_script(cfg, run_dir, WORKDIR)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    output = next(l for l in text.splitlines() if l.startswith("#SBATCH --output="))
    # sbatch splits an #SBATCH line at white space outside double quotes, as shlex does here
    assert shlex.split(output) == ["#SBATCH", f"--output={run_dir}/slurm-%j.out"]
    assert sbatch.sbatch_quote('a "b"\\c') == '"a \\"b\\"\\\\c"'


@pytest.mark.parametrize("name", sbatch.PRESETS)
def test_ready_scripts_match_their_presets(name):
    path = REPO / "sbatch" / f"{name}.sbatch"
    assert path.read_text() == sbatch.render_preset(name), (
        f"{path} differs from PRESETS[{name!r}]: python -m relax_slurm.launch.sbatch "
        "--write-presets sbatch")
    assert os.access(path, os.X_OK)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_ready_scripts_pass_overrides_and_requeue():
    for name in sbatch.PRESETS:
        text = (REPO / "sbatch" / f"{name}.sbatch").read_text()
        assert text.rstrip().endswith('"$@"'), name  # Hydra overrides passed through
        for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append",
                     "#SBATCH --signal=B:USR1@120", "slurm_driver --compose"):
            assert line in text, (name, line)


def test_hetjob_blocks_and_job_wide_options():
    lines = sbatch.sbatch_lines(cfg_for(CASES["multinode"]).cluster, "out-%j")
    sep = lines.index("#SBATCH hetjob")
    first, second = lines[:sep], lines[sep + 1:]
    assert "#SBATCH --signal=B:USR1@300" in first and "#SBATCH --requeue" in first
    assert not any("--signal" in l or "--output" in l for l in second)  # job-wide: once
    assert "#SBATCH --partition=gpu" in first and "#SBATCH --partition=gpu-inference" in second
    assert "#SBATCH --nodes=2" in first and "#SBATCH --nodes=2" in second
    assert "#SBATCH --mem=0" in first and "#SBATCH --exclusive" in second


def test_colocated_is_one_block_with_all_nodes():
    lines = sbatch.sbatch_lines(SlurmClusterConfig(layout="colocated", trainer_nodes=2,
                                                   rollout_nodes=1, requeue=False,
                                                   signal_lead_s=0),
                                "o")
    assert "#SBATCH hetjob" not in lines and "#SBATCH --nodes=3" in lines
    assert "#SBATCH --no-requeue" in lines and not any("--signal" in l for l in lines)


def test_dry_run_shows_script_and_one_srun_per_role():
    cfg = cfg_for(CASES["multinode"])
    text = sbatch.dry_run_text(cfg, RUN_DIR, WORKDIR)
    assert text.startswith("#!/bin/bash")
    sruns = [shlex.split(l) for l in text.splitlines() if l.startswith("srun ")]
    names = [next(a for a in s if a.startswith("--job-name=")).split("=")[1] for s in sruns]
    assert names == ["broker", "engine0", "engine1", "engine2", "engine3", "rollout", "trainer"]
    trainer = sruns[-1]
    assert "--het-group=0" in trainer and "--nodes=2" in trainer
    assert "--nodelist=trainer-node1,trainer-node2" in trainer
    assert all("--het-group=1" in s for s in sruns[1:6])
    assert all("--overlap" in s and "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in s
               for s in sruns)


def test_run_sbatch_dry_run_submits_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sbatch, "submit_script", lambda p: pytest.fail("submitted"))
    cfg = cfg_for(["cluster.dry_run=true"])
    cfg.run_dir = str(tmp_path / "run")
    assert sbatch.run_sbatch(cfg) == 0
    out = capsys.readouterr().out
    assert "#SBATCH hetjob" in out and "srun --het-group=1" in out
    assert not (tmp_path / "run").exists()


def test_submit_failure_and_job_id_parsing(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        if cmd[0] == "sbatch":
            return subprocess.CompletedProcess(cmd, 0, "1234;cluster\n", "")
        return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id")

    monkeypatch.setattr(sbatch, "_run", fake_run)
    assert sbatch.submit_script(tmp_path / "x.sbatch") == "1234"
    assert sbatch.job_states("1234") == []
    assert sbatch.wait_for_job("1234", tmp_path, 0.01)["state"] == "unknown"


def test_wait_survives_a_busy_slurmctld(tmp_path, monkeypatch, capsys):
    # a loaded slurmctld times out a query now and then; that must not end relax-train's wait
    # while the job runs on
    busy = subprocess.CompletedProcess(["squeue"], 1, "", "slurm_load_jobs error: Socket timed "
                                       "out on send/recv operation")
    answers = [busy, busy, subprocess.CompletedProcess(["squeue"], 0, "RUNNING\nRUNNING\n", ""),
               busy, subprocess.CompletedProcess(["squeue"], 0, "", "")]
    monkeypatch.setattr(sbatch, "_run", lambda cmd, **kw: answers.pop(0))
    monkeypatch.setattr(sbatch.time, "sleep", lambda s: None)
    (tmp_path / "slurm_status.json").write_text('{"state": "completed"}')
    assert sbatch.wait_for_job("7", tmp_path, 0.01)["state"] == "completed"
    assert not answers
    out = capsys.readouterr().out
    assert "job 7: RUNNING" in out and out.count("retrying") == 3

    answers[:] = [busy] * (sbatch.SQUEUE_RETRIES + 1)
    with pytest.raises(sbatch.RelaxError, match="may still be running"):
        sbatch.wait_for_job("7", tmp_path, 0.01)


def test_sft_dry_run_is_one_plain_component_with_the_trainer_alone():
    """algo=sft needs no broker, engines or rollout worker: whatever cluster.layout says, the
    job is one component of cluster.trainer_nodes and the driver starts one srun step."""
    cfg = compose_config(["experiment=tiny_sft_cpu", "cluster=slurm", f"run_dir={RUN_DIR}",
                          "cluster.python=/opt/venv/bin/python", "cluster.trainer_nodes=2",
                          "cluster.rollout_nodes=3", "cluster.gpus_per_node=8",
                          "trainer.nproc_per_node=8", "cluster.dry_run=true"])
    assert cfg.cluster.layout == "hetjob"
    text = sbatch.dry_run_text(cfg, RUN_DIR, WORKDIR)
    assert "#SBATCH hetjob" not in text and "#SBATCH --nodes=2" in text
    assert "--nodes=3" not in text and "rollout-node" not in text
    sruns = [shlex.split(l) for l in text.splitlines() if l.startswith("srun ")]
    assert len(sruns) == 1
    trainer = sruns[0]
    assert "--job-name=trainer" in trainer and "--nodelist=trainer-node1,trainer-node2" in trainer
    assert not any(a.startswith("--het-group") for a in trainer)
    assert "relax_slurm.trainer" in trainer and "--nproc-per-node=8" in trainer


def test_dry_run_renders_the_managed_judge_in_the_rollout_component():
    cfg = cfg_for(["reward.name=genrm", "reward.genrm_model_path=/models/judge"])
    text = sbatch.dry_run_text(cfg, RUN_DIR, WORKDIR)
    sruns = [shlex.split(l) for l in text.splitlines() if l.startswith("srun ")]
    judge = [s for s in sruns if "--job-name=genrm" in s]
    assert len(judge) == 1 and "--het-group=1" in judge[0]
    assert judge[0][judge[0].index("--model-path") + 1] == "/models/judge"


def test_a_failed_sbatch_leaves_no_run_directory(tmp_path, monkeypatch):
    from relax_slurm.errors import RelaxError
    from relax_slurm.launch import inputs

    bin_dir = tmp_path / "bin"  # a real `sbatch` that refuses, as a full queue or bad account
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Invalid account' >&2\n"
                                    "exit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(inputs, "check_inputs", lambda cfg: None)  # no model needed to submit
    cfg = cfg_for([])
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)  # what Hydra made before relax-train ran
    cfg.run_dir = str(run_dir)
    with pytest.raises(RelaxError, match="Invalid account"):
        sbatch.submit_run(cfg)
    assert not run_dir.exists(), list(run_dir.rglob("*"))


def test_a_dry_run_writes_nothing_not_even_hydras_directory(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
                        "cluster=slurm", "cluster.dry_run=true", f"run_dir={run_dir}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH" in r.stdout
    assert list(tmp_path.iterdir()) == []
