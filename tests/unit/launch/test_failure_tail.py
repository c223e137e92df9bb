"""What the launcher says of a role that failed: its log's last lines, and, when the error it
logged is above them, that error's line. A torchrun trainer whose rank refused its config
ended its log with torchrun's own ~25-line summary of which rank failed, so the message showed
exit codes and "error_file: <N/A>" and never the refusal (seen with trainer.nproc_per_node=3
on the tiny run); the user had to open logs/trainer.log. Here a real torchrun agent (the
launcher's `relax_slurm.runtime.torchrun`) with one rank that raises."""

from __future__ import annotations

import os
import sys

from relax_slurm.launch.processes import LOG_TAIL_LINES, ProcessSet
from tests.conftest import REPO

RANK = ("from relax_slurm.errors import ConfigError\n"
        "raise ConfigError('rollout.batch_size x rollout.n_samples_per_prompt = 512 samples "
        "per step do not split evenly over 3 data-parallel trainer ranks')\n")


def _failed_torchrun_role(tmp_path, rank_source: str, env: dict[str, str]):
    """A real torchrun agent (the launcher's) whose one rank runs `rank_source` and fails:
    the role and the launcher's message about it."""
    script = tmp_path / "rank.py"
    script.write_text(rank_source)
    procs = ProcessSet(tmp_path, env | {"PYTHONPATH": str(REPO)})
    try:
        role = procs.start("trainer", [sys.executable, "-m", "relax_slurm.runtime.torchrun",
                                       "--nproc-per-node=1", "--monitor-interval=0.1",
                                       str(script)])
        assert role.proc.wait(timeout=120) == 1
        return role, str(role.failure("exited with code 1"))
    finally:
        procs.close()


def test_a_failed_torchrun_role_names_its_ranks_error(tmp_path):
    role, message = _failed_torchrun_role(tmp_path, RANK, dict(os.environ))
    log = role.log.read_text().splitlines()
    assert len(log) > LOG_TAIL_LINES  # torchrun's summary alone fills the tail
    assert message.splitlines()[0].endswith("Last lines:")  # the Slurm driver reads that line
    assert message.splitlines()[-1] == (
        "... the error it logged last, above those lines: relax_slurm.errors.ConfigError: "
        "rollout.batch_size x rollout.n_samples_per_prompt = 512 samples per step do not "
        "split evenly over 3 data-parallel trainer ranks"), message


CRASH = ("import ctypes\n"
         "def read_freed_memory():\n"
         "    ctypes.memset(0, 0, 1)  # SIGSEGV in native code, as a read of freed memory\n"
         "read_freed_memory()\n")


def test_a_rank_that_dies_in_native_code_is_named_with_its_frame(tmp_path):
    """A rank killed by SIGSEGV (a relax-ctl dump once did that: runtime/stacks.py) used to
    leave torchrun's summary and "exitcode: -11" alone; the roles' environment turns on
    faulthandler, and the message names the fatal error and the Python frame it hit."""
    from relax_slurm.config import TrainConfig
    from relax_slurm.launch.roles import child_env

    _, message = _failed_torchrun_role(tmp_path, CRASH, child_env(TrainConfig(), "secret"))
    script = tmp_path / "rank.py"
    assert "SIGSEGV" in message  # torchrun's summary, the tail
    assert message.splitlines()[-1] == (
        "... the error it logged last, above those lines: Fatal Python error: Segmentation "
        f"fault in read_freed_memory ({script}:3)"), message


def test_an_error_already_in_the_tail_is_not_said_twice(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("\n".join([*(f"line {i}" for i in range(30)), "Traceback (most recent call "
                              "last):", '  File "x.py", line 1, in <module>',
                              "ValueError: bad model path"]) + "\n")
    procs = ProcessSet(tmp_path, dict(os.environ))
    role = procs.start("engine", [sys.executable, "-c", "pass"])
    role.proc.wait(timeout=60)
    procs.close()
    message = str(role.failure("exited with code 0"))
    assert message.count("ValueError: bad model path") == 1
    assert "above those lines" not in message


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_before_anything_starts(
        tmp_path, tiny_assets):
    """The same refusal, now from the launcher's input check: no role is started."""
    import subprocess

    from tests.conftest import run_env, tiny_command

    r = subprocess.run(tiny_command(tmp_path / "run", tiny_assets, "trainer.nproc_per_node=3"),
                       cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert ("512 samples per step do not split evenly over 3 data-parallel trainer ranks "
            "(trainer.nproc_per_node x cluster.trainer_nodes): make rollout.batch_size x "
            "rollout.n_samples_per_prompt a multiple of 3") in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started
