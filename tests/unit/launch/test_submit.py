"""submit(): the submitit parameters of a het job, and reading het jobs' sacct rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from relax_slurm.errors import ConfigError
from relax_slurm.launch import submit as sub


def cfg_for(*overrides: str):
    return sub.compose_config(sub.slurm_overrides(["experiment=tiny_cpu", *overrides],
                                                  default_run_dir="/tmp/relax-unit-run"))


def test_overrides_default_to_slurm_and_a_run_dir():
    assert sub.slurm_overrides(["a=1"], "runs/x") == ["cluster=slurm", "a=1", "run_dir=runs/x"]
    assert sub.slurm_overrides(["cluster=local", "run_dir=r"], "runs/x") == ["cluster=local",
                                                                             "run_dir=r"]
    assert cfg_for().cluster.kind == "slurm"


def test_het_job_script_through_submitit(tmp_path):
    params = sub.executor_parameters(cfg_for("cluster.partition=cpu", "cluster.account=p1",
                                             "cluster.setup_lines=[source venv/bin/activate]"),
                                     Path("/home/me/project"))
    text = _make_sbatch_string(command="exec /venv/python -u -m submitit.core._submit F",
                               folder=tmp_path, **params)
    lines = text.splitlines()
    sep = lines.index("#SBATCH hetjob")
    first = [l for l in lines[:sep] if l.startswith("#SBATCH")]
    second = [l for l in lines[sep + 1:] if l.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@120" in first  # ours, instead of submitit's USR2
    assert sum("--signal" in l for l in lines) == 1
    assert "#SBATCH --requeue" in first and "#SBATCH --partition=cpu" in first
    assert "#SBATCH --partition=cpu" in second and "#SBATCH --account=p1" in second
    # every component option precedes the first command: sbatch stops reading #SBATCH there
    first_cmd = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
    assert all(i < first_cmd for i, l in enumerate(lines) if l.startswith("#SBATCH"))
    assert "source venv/bin/activate" in text and "cd /home/me/project" in text
    assert lines[lines.index("export SUBMITIT_EXECUTOR=slurm") + 1].startswith(
        "exec /venv/python")  # exec: the driver gets B:USR1
    assert "srun" not in text  # use_srun=False: the driver starts its own steps


def test_colocated_has_no_hetjob_lines():
    params = sub.executor_parameters(cfg_for("cluster.layout=colocated", "cluster.trainer_nodes=2",
                                             "cluster.rollout_nodes=1", "cluster.requeue=false"),
                                     Path("/w"))
    assert params["nodes"] == 3 and not any("hetjob" in s for s in params["setup"])
    assert params["additional_parameters"]["no-requeue"] is True


def test_extra_sbatch_args():
    assert sub.sbatch_params(["--constraint=a100", "--exclusive"]) == {
        "constraint": "a100", "exclusive": True}
    with pytest.raises(ConfigError, match="long form"):
        sub.sbatch_params(["-C", "a100"])


def test_het_job_state_is_read_from_component_0():
    executor = sub.job_classes()
    watcher = executor.job_class.watcher
    out = ("JobID|State|NodeList\n"
           "41+0|RUNNING|ci0\n41+0.batch|RUNNING|ci0\n41+0.1|RUNNING|ci0\n"
           "41+1|RUNNING|ci1\n41+1.0|RUNNING|ci1\n"
           "40|COMPLETED|ci2\n")
    info = watcher.read_info(out)
    assert info["41"]["State"] == "RUNNING" and info["41"]["NodeList"] == "ci0"
    assert info["40"]["State"] == "COMPLETED"
    done = watcher.read_info("JobID|State|NodeList\n41+0|COMPLETED|ci0\n41+1|COMPLETED|ci1\n")
    assert done["41"]["State"] == "COMPLETED"


@pytest.mark.parametrize("mem_gb,line", [(64, "--mem=64G"), (0, "--mem=0"), (None, None)])
def test_memory_has_its_unit_in_every_component(tmp_path, mem_gb, line):
    # submitit writes `mem` as given: a bare 64 would ask component 0 for 64 MB
    value = "null" if mem_gb is None else mem_gb
    params = sub.executor_parameters(cfg_for(f"cluster.mem_gb={value}"), Path("/w"))
    text = _make_sbatch_string(command="exec py -u -m x", folder=tmp_path, **params)
    mems = [l.split(" ", 1)[1] for l in text.splitlines() if l.startswith("#SBATCH --mem")]
    assert mems == ([] if line is None else [line, line])  # component 0, then component 1
