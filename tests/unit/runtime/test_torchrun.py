"""runtime.torchrun, the trainer role's agent: torchrun itself, which leaves at once when its
ranks finished, and fails like torchrun when one of them fails."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

# a rank without torch: torchrun's environment on file, then the exit code asked for
RANK = """
import os, sys
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(os.environ["WORLD_SIZE"])
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""


def agent(module: str, tmp_path, rank_exit: int) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=0.1", str(script), str(tmp_path), str(rank_exit)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_ranks_that_finish_end_the_agent_with_0(tmp_path):
    r = agent("relax_slurm.runtime.torchrun", tmp_path, rank_exit=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(tmp_path / f"rank{k}").read_text() for k in (0, 1)] == ["2", "2"]


@pytest.mark.timeout(300)
def test_a_failed_rank_fails_the_agent_as_torchrun_does(tmp_path):
    for d in ("ours", "theirs"):
        (tmp_path / d).mkdir()
    ours = agent("relax_slurm.runtime.torchrun", tmp_path / "ours", 3)
    theirs = agent("torch.distributed.run", tmp_path / "theirs", 3)
    assert theirs.returncode == 1  # torchrun reports a failed rank as its generic 1
    assert ours.returncode == theirs.returncode, ours.stderr[-3000:]
    for r in (ours, theirs):  # torchrun's own report, naming the rank and its exit code
        assert "ChildFailedError" in r.stderr and "exitcode  : 3" in r.stderr, r.stderr[-3000:]
