"""Roles forked by the zygote (runtime/zygote.py) are the programs a fresh process would run:
their command line, environment, session, log, exit status and parent, and they die with the
launcher, while what the zygote imported is imported once for all of them.

Each test runs a launcher of its own in a subprocess: a launcher is a child subreaper
(`adopt_orphans`), which a pytest worker must not become (it would inherit every orphan of the
tests after it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers_tiny import REPO_ROOT, alive

# the role: a module run with `python -m role ...`; `heavy` stands for torch (it counts the
# processes that import it, in imports.txt)
HEAVY = """
import os, sys
with open(os.environ["COUNT_FILE"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""
ROLE = """
import json, os, sys, time
was_imported = "heavy" in sys.modules
import heavy
out = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "argv": sys.argv[1:],
       "env": os.environ.get("ROLE_SETTING"), "cwd": os.getcwd(), "preloaded": was_imported,
       "cmdline": open("/proc/self/cmdline", "rb").read().decode(), "name": __name__}
print("role says: " + json.dumps(out), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
if sys.argv[1] == "raise":
    raise ValueError("the role's own error")
sys.exit(int(sys.argv[1]))
"""

LAUNCHER = """
import json, os, signal, sys, time
from pathlib import Path
from relax_slurm.runtime.lifetime import adopt_orphans
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.runtime.zygote import Forked, Zygote

tmp = Path(sys.argv[1])
assert adopt_orphans()
env = dict(os.environ, ROLE_SETTING="for the roles")
zygote = Zygote.start({"role": ["heavy"]}, dict(os.environ, ROLE_SETTING="the zygote's"))
procs = ProcessSet(tmp, env, zygote)
out = {"launcher": os.getpid()}
for name, arg in (("three", "3"), ("raises", "raise"), ("waits", "wait")):
    role = procs.start(name, [sys.executable, "-m", "role", arg])
    out[name] = {"forked": isinstance(role.proc, Forked), "pid": role.proc.pid}
for name in ("three", "raises"):
    role = next(r for r in procs.roles if r.name == name)
    out[name]["rc"] = role.proc.wait(timeout=60)
waits = next(r for r in procs.roles if r.name == "waits")
deadline = time.monotonic() + 60
while "role says" not in (tmp / "waits.log").read_text(errors="replace"):  # it runs
    assert time.monotonic() < deadline and waits.proc.poll() is None
    time.sleep(0.02)
if sys.argv[2] == "die":  # the test SIGKILLs this launcher: the role must go with it
    print(json.dumps(out), flush=True)
    time.sleep(600)
os.kill(waits.proc.pid, signal.SIGKILL)
out["waits"]["rc"] = waits.proc.wait(timeout=60)
# a module the zygote was not told of (SGLang's server, say) starts as a process of its own
other = procs.start("other", [sys.executable, "-m", "other", "0"])
out["other"] = {"forked": isinstance(other.proc, Forked), "rc": other.proc.wait(timeout=60)}
zygote.proc.kill()  # a dead zygote: the next role starts as a process of its own
zygote.proc.wait()
late = procs.start("late", [sys.executable, "-m", "role", "0"])
out["late"] = {"forked": isinstance(late.proc, Forked), "pid": late.proc.pid,
               "rc": late.proc.wait(timeout=60)}
procs.close()
print(json.dumps(out), flush=True)
"""


def _setup(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "heavy.py").write_text(HEAVY)
    (tmp_path / "role.py").write_text(ROLE)
    (tmp_path / "other.py").write_text(ROLE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}",
                COUNT_FILE=str(tmp_path / "imports.txt"))


def _said(log: Path) -> dict:
    line = next(x for x in log.read_text().splitlines() if x.startswith("role says: "))
    return json.loads(line.removeprefix("role says: "))


def test_a_forked_role_is_the_program_it_stands_for_and_imports_nothing_twice(tmp_path):
    env = _setup(tmp_path)
    done = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path), "run"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    for name, arg in (("three", "3"), ("raises", "raise"), ("waits", "wait")):
        said = _said(tmp_path / f"{name}.log")
        assert out[name]["forked"] and said["pid"] == out[name]["pid"]
        # the launcher's child (it waits for it), in a session of its own, as with Popen
        assert said["ppid"] == out["launcher"] and said["sid"] == said["pid"]
        assert said["argv"] == [arg] and said["name"] == "__main__"
        assert said["env"] == "for the roles" and said["cwd"] == str(tmp_path)
        assert said["cmdline"].startswith(f"{sys.executable} -m role {arg}")
        assert said["preloaded"]  # the zygote's import, inherited
    assert out["three"]["rc"] == 3
    assert out["raises"]["rc"] == 1
    assert "ValueError: the role's own error" in (tmp_path / "raises.log").read_text()
    assert out["waits"]["rc"] == -signal.SIGKILL
    assert not out["other"]["forked"] and out["other"]["rc"] == 0
    assert not _said(tmp_path / "other.log")["preloaded"]
    # the zygote gone, a role starts as its own process and imports for itself
    assert not out["late"]["forked"] and out["late"]["rc"] == 0
    assert not _said(tmp_path / "late.log")["preloaded"]
    # the zygote, `other` and `late`: not the three roles forked
    assert len((tmp_path / "imports.txt").read_text().split()) == 3


def test_a_forked_role_dies_with_its_launcher(tmp_path):
    """A launcher killed outright runs no `finally`: its forked roles get SIGTERM from the
    kernel (PR_SET_PDEATHSIG, set once the launcher adopted them, not while the zygote's
    middle child was their parent), as its Popen children do."""
    env = _setup(tmp_path)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path),
                                 "die"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                text=True)
    try:
        out = json.loads(launcher.stdout.readline())
        role = out["waits"]["pid"]
        assert _said(tmp_path / "waits.log")["pid"] == role
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(role) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(role)
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
