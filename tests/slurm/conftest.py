"""A real Slurm for tests/slurm: the one that already answers, or tools/slurm/up.sh's.

Once per session: if `scontrol ping` answers (an existing cluster, or ours left running), it is
used as it is and left running. Otherwise tools/slurm/up.sh starts the local single-host
cluster (installing slurm-wlm + munge with apt-get when missing and possible; about 12 s when
installed, a few minutes with the install) and tools/slurm/down.sh stops it at the end. If it
cannot be started (no root for apt, no packages), every `slurm` test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

TOOLS = REPO / "tools" / "slurm"
CI_DIR = Path(os.environ.get("SLURM_CI_DIR", "/tmp/relax-slurm-ci"))
UP_TIMEOUT_S = 1500  # apt-get install and MariaDB's first start included, on a busy machine
DOWN_TIMEOUT_S = 120


def _ping(env: dict[str, str]) -> bool:
    try:
        r = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "is UP" in r.stdout


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """Environment (PATH, SLURM_CONF) under which sbatch/squeue/sacct reach the cluster; also
    exported to this process for the in-process submitit API while the session runs."""
    base = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    ours = {**base, "SLURM_CI_DIR": str(CI_DIR), "SLURM_CONF": str(CI_DIR / "etc/slurm.conf")}
    started = False
    if shutil.which("sbatch", path=base["PATH"]) and _ping(base):
        env = base
    elif _ping(ours):
        env = ours
    else:
        try:
            r = subprocess.run(["bash", str(TOOLS / "up.sh")], env=ours, capture_output=True,
                               text=True, timeout=UP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.skip(f"tools/slurm/up.sh did not finish within {UP_TIMEOUT_S}s: "
                        f"{_tail(str(e.stdout or ''))}")
        if r.returncode != 0 or not _ping(ours):
            pytest.skip("no Slurm: `sbatch` does not reach a cluster and tools/slurm/up.sh could "
                        f"not start one (it needs root or preinstalled slurm-wlm):\n"
                        f"{_tail(r.stdout + r.stderr)}")
        env, started = ours, True
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    os.environ.update({k: env[k] for k in ("PATH",)})
    if "SLURM_CONF" in env:
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if started:  # only what this session started
            subprocess.run(["bash", str(TOOLS / "down.sh")], env=ours, capture_output=True,
                           timeout=DOWN_TIMEOUT_S)
