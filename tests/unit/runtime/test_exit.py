"""runtime.exit.exit_now: a role leaves at once, and leaves no helper process behind."""

import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.helpers_tiny import alive

SCRIPT = """
import multiprocessing as mp, sys
from relax_slurm.runtime.exit import exit_now
manager = mp.get_context("spawn").Manager()  # as megatron-core's checkpoint writer starts one
queue = manager.Queue()
open(sys.argv[1], "w").write(str(manager._process.pid))
exit_now(0)
"""


@pytest.mark.timeout(120)
def test_exit_now_stops_multiprocessing_helpers(tmp_path):
    # no pipes: a leaked helper would hold them open and hang the wait instead of failing
    pid_file = tmp_path / "helper.pid"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(pid_file)], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=90)
    assert out.returncode == 0
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(helper)
    if left:  # never leave it running, whatever the outcome
        subprocess.run(["kill", "-9", str(helper)])
    assert not left, "the Manager process outlived exit_now"
