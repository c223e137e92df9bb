"""A real Slurm for tests/slurm: tools/slurm/up.sh's single-host cluster, once per session.

The first `slurm` test runs tools/slurm/up.sh (idempotent: ~10 s when the cluster is already
up or the packages are installed; on a fresh machine it first runs `apt-get install slurm-wlm
munge ...`, a few minutes). The session's end runs tools/slurm/down.sh, which cancels every job
of that cluster and stops its daemons, unless the cluster was already running before the
session (then it is left as found) or RELAX_SLURM_KEEP=1.

Skipped (with the reason) only where up.sh cannot work at all: Slurm not installed and no way
to install it (not root, or no apt-get). Anywhere else a failed bring-up fails the tests.

While the session runs, a thread touches the partition every NUDGE_EVERY_S (`scontrol update
PartitionName=debug State=UP`, a no-op): only the backfill scheduler starts het jobs, and it
runs only after some job, node or partition changed. A requeued het job may start
`cred_expire` + 1 s (11 s) after its requeue, but on this otherwise idle cluster nothing changes
then until the next priority recalculation (PriorityCalcPeriod, a minute): the preempted and
drained-node tests waited 36-55 s more for it. A busy cluster changes all the time; the thread
makes this one behave so (the requeue path itself is the same).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO

TOOLS = REPO / "tools" / "slurm"
CI_DIR = Path(os.environ.get("SLURM_CI_DIR", "/tmp/relax-slurm-ci"))
UP_TIMEOUT_S = 900  # apt-get install + MariaDB's first start on a busy 2-core machine: ~4 min
DOWN_TIMEOUT_S = 180
# what every `slurm` test's timeout mark adds for the session's bring-up, which pytest-timeout
# counts against the first test that asks for the cluster (tiny_assets included)
SETUP_ALLOWANCE_S = UP_TIMEOUT_S + 300
NUDGE_EVERY_S = 2.0  # backfill then runs within ~NUDGE_EVERY_S + bf_interval of a job's start time


def _ping(env: dict[str, str]) -> bool:
    if not shutil.which("scontrol", path=env["PATH"]):
        return False
    try:
        r = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "is UP" in r.stdout


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _cannot_install(env: dict[str, str]) -> str | None:
    """Why up.sh cannot possibly work here, or None."""
    if all(shutil.which(b, path=env["PATH"]) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0:
        return "slurm-wlm/munge are not installed and installing them needs root"
    if not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and there is no apt-get to install them"
    return None


def _nudge_scheduler(env: dict[str, str], stop: threading.Event) -> None:
    """Touch the partition every NUDGE_EVERY_S until `stop` (see the module's docstring)."""
    while not stop.wait(NUDGE_EVERY_S):
        try:
            subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], env=env,
                           capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass  # a busy slurmctld: the next touch, or the minute's recalculation, will do


@pytest.fixture(scope="session")
def slurm_env():
    """Environment (PATH with sbin, SLURM_CONF) under which sbatch/squeue/sacct reach the test
    cluster; SLURM_CONF is also exported to this process (for the in-process submitit API)
    while the session runs."""
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
           "SLURM_CI_DIR": str(CI_DIR), "SLURM_CONF": str(CI_DIR / "etc" / "slurm.conf")}
    reason = _cannot_install(env)
    if reason:
        pytest.skip(f"no Slurm for the `slurm` tests: {reason}")
    was_up = _ping(env)
    try:
        r = subprocess.run(["bash", str(TOOLS / "up.sh")], env=env, capture_output=True,
                           text=True, timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"tools/slurm/up.sh did not finish within {UP_TIMEOUT_S}s:\n{_tail(out)}")
    if r.returncode != 0 or not _ping(env):
        pytest.fail(f"tools/slurm/up.sh failed (exit {r.returncode}):\n"
                    f"{_tail(r.stdout + r.stderr, 40)}")
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    os.environ.update(SLURM_CONF=env["SLURM_CONF"], PATH=env["PATH"])
    stop = threading.Event()
    nudge = threading.Thread(target=_nudge_scheduler, args=(env, stop), daemon=True,
                             name="slurm-nudge")
    nudge.start()
    try:
        yield env
    finally:
        stop.set()
        nudge.join(timeout=35)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not was_up and os.environ.get("RELAX_SLURM_KEEP") != "1":
            subprocess.run(["bash", str(TOOLS / "down.sh")], env=env, capture_output=True,
                           timeout=DOWN_TIMEOUT_S)
