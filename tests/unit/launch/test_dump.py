"""launch/dump.py and `relax-ctl dump` on real processes standing in for a run's roles: every
live registered process is signalled and its stacks copied under its role's name; a stopped
one is named as not answering; a process that did not register is never signalled (SIGUSR2
would end it) and its role is named as not registered. On Slurm the same pids are signalled
by a command run on their node, checked here by running that command locally."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_slurm.launch.dump import REMOTE_KILL, dump_stacks, slurm_kill_command
from relax_slurm.runtime.stacks import DUMP_SIGNAL, stacks_dir
from tests.conftest import REPO, run_env
from tests.helpers_tiny import alive

# ROLE RUN_DIR NAME CHILD: registers as NAME (unless "-"), starts CHILD (a ROLE of its own)
# unless "-", prints its child's pid (0 without one), then waits in stand_in_role_loop
ROLE = """
import subprocess, sys, time
from relax_slurm.runtime.stacks import register_stack_dumps

def stand_in_role_loop():
    if sys.argv[2] != "-":
        register_stack_dumps(sys.argv[1], sys.argv[2])
    child = None
    if sys.argv[3] != "-":
        child = subprocess.Popen([sys.executable, __file__, sys.argv[1], sys.argv[3], "-"],
                                 stdout=subprocess.DEVNULL)
    print(child.pid if child else 0, flush=True)
    while True:
        time.sleep(0.05)

stand_in_role_loop()
"""
WAIT_S = 60.0


def _role(script: Path, run_dir: Path, name: str, child: str = "-"
          ) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), name, child], cwd=REPO,
                            env=run_env(), stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _registered(run_dir: Path, pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not list(stacks_dir(run_dir).glob(f"*-{pid}.txt")):
        assert time.monotonic() < deadline, f"pid {pid} did not register"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_relax_ctl_dump_copies_every_live_roles_stacks_and_names_the_silent(tmp_path, capsys):
    from relax_slurm.launch.ctl import main

    script = tmp_path / "role.py"
    script.write_text(ROLE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("cluster:\n  kind: local\n")
    (run_dir / "plan.json").write_text("{}\n")
    procs, pids = [], {}
    try:
        for name, registers_as, child in [("broker", "broker", "-"),
                                          ("engine0", "engine-30001", "-"),
                                          ("rollout", "rollout", "-"),
                                          ("trainer", "trainer-agent", "trainer-rank0"),
                                          ("teacher0", "-", "-")]:
            proc, child_pid = _role(script, run_dir, registers_as, child)
            procs.append(proc)
            pids[name] = proc.pid
            if child_pid:
                pids["trainer-rank0"] = child_pid
        for name, pid in pids.items():
            if name != "teacher0":
                _registered(run_dir, pid)
        (run_dir / "roles.json").write_text(json.dumps(
            [{"name": n, "pid": pids[n], "host": "127.0.0.1", "ports": {"http": 30001}
              if n == "engine0" else {}} for n in ("broker", "engine0", "rollout", "trainer",
                                                    "teacher0")]))
        os.kill(pids["rollout"], signal.SIGSTOP)  # frozen: cannot answer
        rc = main(["dump", str(run_dir), "--wait-s", "8"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        reply = json.loads(out)
        folder = Path(reply["folder"])
        assert folder.parent == run_dir / "diagnostics"
        assert reply["answered"] == ["broker", "engine0", "trainer-agent", "trainer-rank0"]
        assert reply["did_not_answer"] == ["rollout"]
        assert reply["not_registered"] == ["teacher0"]
        assert json.loads((folder / "dump.json").read_text()) == reply
        assert sorted(p.name for p in folder.iterdir()) == [
            "broker.txt", "dump.json", "engine0.txt", "trainer-agent.txt", "trainer-rank0.txt"]
        for name in reply["answered"]:
            text = (folder / f"{name}.txt").read_text()
            pid = pids["trainer" if name == "trainer-agent" else name]
            assert text.startswith(f"# {name}: ") and f"pid {pid} " in text
            assert text.count("stand_in_role_loop") == 1, text  # this dump only, no header
        assert all(alive(pid) for pid in pids.values())  # teacher0 was not signalled
        # a second dump: a folder of its own, only what was written since
        os.kill(pids["rollout"], signal.SIGCONT)
        again = dump_stacks(run_dir, WAIT_S)
        assert again.folder != folder and again.did_not_answer == []
        assert "rollout" in again.answered
        assert (again.folder / "broker.txt").read_text().count("stand_in_role_loop") == 1
        # the SIGSTOPped rollout's pending signal was answered when it went on: in its raw
        # file (stacks/), not in the folder of the dump that gave up on it
        assert not (folder / "rollout.txt").exists()
    finally:
        for proc in procs:
            proc.kill()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in procs:
            proc.wait(timeout=30)


@pytest.mark.timeout(120)
def test_the_slurm_command_signals_only_relax_processes_and_says_which(tmp_path):
    cmd = slurm_kill_command("123", "node7", [11, 22])
    assert cmd[:8] == ["srun", "--jobid=123", "--overlap", "--nodes=1", "--ntasks=1",
                       "--nodelist=node7", "--gpus-per-node=0", "--job-name=relax-dump"]
    assert cmd[8:] == ["sh", "-c", REMOTE_KILL, "relax-dump", "11", "22"]
    # in a het job: the component that holds the node
    assert slurm_kill_command("123", "node7", [11], het_group=1)[:3] == [
        "srun", "--jobid=123", "--het-group=1"]
    # what srun runs on the node, run here: a relax_slurm process that registered is
    # signalled and printed; another process (a reused pid) and a gone pid are left alone
    (tmp_path / "relax_slurm_role.py").write_text(
        "import sys, time\nfrom relax_slurm.runtime.stacks import register_stack_dumps\n"
        "register_stack_dumps(sys.argv[1], 'broker')\nprint('ok', flush=True)\n"
        "while True:\n    time.sleep(0.05)\n")
    ours = subprocess.Popen([sys.executable, str(tmp_path / "relax_slurm_role.py"),
                             str(tmp_path)], env=run_env(), stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["sleep", "300"])
    try:
        assert ours.stdout.readline().strip() == "ok"
        gone = subprocess.Popen(["true"])
        gone.wait()
        out = subprocess.run(cmd[8:11] + ["relax-dump", str(ours.pid), str(other.pid),
                                          str(gone.pid)],
                             capture_output=True, text=True, timeout=60).stdout
        assert out.split() == [str(ours.pid)]
        path = stacks_dir(tmp_path) / f"broker-{ours.pid}.txt"
        deadline = time.monotonic() + WAIT_S
        while "Main thread 0x" not in path.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ours.poll() is None and other.poll() is None
        assert DUMP_SIGNAL == signal.SIGUSR2
    finally:
        ours.kill()
        other.kill()
        ours.wait(timeout=30)
        other.wait(timeout=30)


def test_a_hang_whose_dump_fails_is_still_reported_and_recovered(tmp_path):
    """The supervisor's dump before a hang's restart (supervisor.with_stacks) adds where the
    stacks went to the cause; a dump that fails says why and never stops the recovery."""
    from relax_slurm.launch.supervisor import with_stacks

    (tmp_path / "run").mkdir()
    why = with_stacks(tmp_path / "run", "sent no heartbeat")
    assert why.startswith("sent no heartbeat; stacks of every role in "
                          f"{tmp_path / 'run' / 'diagnostics'}/")
    assert why.endswith("(answered: none)")
    (tmp_path / "file").write_text("")  # not a directory: the folder cannot be made
    assert with_stacks(tmp_path / "file", "sent no heartbeat").startswith(
        "sent no heartbeat; no stack dump (NotADirectoryError")
