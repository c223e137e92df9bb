"""The CPU SGLang venv's builder (relax_slurm/engines/sglang_cpu): built once under a file lock
when several processes ask at once, renamed into place only when complete, rebuilt when the
recipe or a shim changes. The pip steps are left out here (a bare venv, seconds); the real
build, from PyPI, is the session fixture of tests/integration/test_sglang_cpu_e2e.py."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_slurm.engines import sglang_cpu
from relax_slurm.errors import EngineError

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)

# ensure_venv without the pip steps, in a process of its own (as two relax-train runs are)
BARE_BUILD = """
import sys
from relax_slurm.engines import sglang_cpu
sglang_cpu._steps = lambda python, constraints: []
print("PYTHON", sglang_cpu.ensure_venv(say=lambda line: print(line, flush=True)), flush=True)
"""


def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def leftovers(root: Path) -> list[str]:
    folder = sglang_cpu.venv_dir(root).parent
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_two_processes_asking_at_once_build_the_venv_once(tmp_path):
    root = tmp_path / "cache"
    lock_path = sglang_cpu.venv_dir(root).parent / ".lock"
    lock_path.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RELAX_SGLANG_CPU_HOME": str(root)}
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build under way: both must wait for it
        logs = [tmp_path / f"p{i}.log" for i in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", BARE_BUILD], env=env,
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
                 for log in logs]
        try:
            wait_for(lambda: all("waiting for it" in log.read_text() for log in logs),
                     "both processes to wait on the lock")
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        for proc in procs:
            assert proc.wait(timeout=240) == 0
    outs = [log.read_text() for log in logs]
    assert sum("building SGLang" in out for out in outs) == 1, outs
    python = sglang_cpu.venv_python(root)
    assert all(f"PYTHON {python}" in out for out in outs), outs
    assert sglang_cpu.is_current(root)
    # the venv works where it was renamed to, and holds the shims
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()
    for shim in ("sgl_kernel/__init__.py", "relax_sglang_cpu_shim.py",
                 "relax_sglang_cpu_shim.pth"):
        assert (Path(site) / shim).read_bytes() == (sglang_cpu.SHIMS / shim).read_bytes()
    assert str(sglang_cpu.venv_dir(root)) in site
    assert leftovers(root) == []


def test_a_changed_shim_or_pin_changes_the_recipe_and_rebuilds(tmp_path, monkeypatch):
    shims = tmp_path / "shims"
    shutil.copytree(sglang_cpu.SHIMS, shims, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sglang_cpu, "SHIMS", shims)
    monkeypatch.setattr(sglang_cpu, "_steps", lambda python, constraints: [])
    root = tmp_path / "cache"
    said: list[str] = []
    sglang_cpu.ensure_venv(root, say=said.append)
    assert sum("building SGLang" in s for s in said) == 1
    said.clear()
    sglang_cpu.ensure_venv(root, say=said.append)
    assert said == []  # current: nothing built, nothing said
    before = sglang_cpu.recipe_hash()
    (shims / "sgl_kernel" / "__init__.py").write_text("# changed\n")
    assert sglang_cpu.recipe_hash() != before and not sglang_cpu.is_current(root)
    sglang_cpu.ensure_venv(root, say=said.append)
    assert sum("building SGLang" in s for s in said) == 1
    assert sglang_cpu.is_current(root) and leftovers(root) == []
    monkeypatch.setattr(sglang_cpu, "REQUIREMENTS", (*sglang_cpu.REQUIREMENTS, "six"))
    assert not sglang_cpu.is_current(root)


def test_a_failed_build_names_the_step_and_leaves_no_venv(tmp_path, monkeypatch):
    failing = [sys.executable, "-c", "print('no matching distribution'); raise SystemExit(3)"]
    monkeypatch.setattr(sglang_cpu, "_steps", lambda python, constraints: [("x", failing)])
    root = tmp_path / "cache"
    with pytest.raises(EngineError, match="exited with 3") as e:
        sglang_cpu.ensure_venv(root, say=lambda line: None)
    assert "no matching distribution" in str(e.value)
    assert not sglang_cpu.venv_dir(root).exists() and leftovers(root) == []


def test_the_command_line_says_where_the_venv_is(tmp_path, capsys, monkeypatch):
    from relax_slurm.engines.sglang_cpu.__main__ import main

    monkeypatch.setenv("RELAX_SGLANG_CPU_HOME", str(tmp_path))
    assert main(["path"]) == 1
    assert "relax-sglang-cpu install" in capsys.readouterr().err
    monkeypatch.setattr(sglang_cpu, "_steps", lambda python, constraints: [])
    assert main(["install"]) == 0
    assert main(["path"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(sglang_cpu.venv_python(tmp_path))
