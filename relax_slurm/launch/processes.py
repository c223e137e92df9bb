"""Child processes of a run: start with a log file per role, watch, and always tear down.

Each child gets its own session so that stopping it also stops what it started (torchrun's
ranks); teardown happens in `close()`, which the local runner calls in `finally`. A launcher that
is killed outright (SIGKILL, OOM killer, a test's timeout) runs no `finally`: every child also
asks the kernel for SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG), so no role outlives
the launcher and keeps a broker, an engine or a trainer running with nobody to stop it.

A process whose parent dies first is re-parented to the launcher (`lifetime.adopt_orphans`,
Linux's child subreaper), not to init where no walk from a role finds it: megatron's async
checkpoint writer, forked by a rank that was SIGKILLed mid-save, lives on in that rank's
session, holding its memory (a GPU's, on a cluster) while the restarted trainer loads.
`restart` and `close` stop such orphans too.

Where it can, a local run's roles are forked by the zygote (runtime/zygote.py) rather than
started as processes of their own: the same programs, without importing torch again in each.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from relax_slurm.errors import RoleFailed
from relax_slurm.runtime.lifetime import adopts_orphans, child_setup

if TYPE_CHECKING:
    from relax_slurm.runtime.zygote import Forked, Zygote

    Child = subprocess.Popen | Forked
    """A role's process: started by `subprocess`, or forked by the zygote and adopted."""

TERM_GRACE_S = 10.0
LOG_TAIL_LINES = 20


# the last line of a Python traceback: `module.Class: message`, a rank's line prefixed by
# torchrun ("[rank0]: ..."); our own errors by their module (EngineLost, BrokerTimeout)
RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:relax_slurm(?:\.\w+)+|(?:\w+\.)*\w*(?:Error|"
                    r"Exception)): .+)$")
# torchrun's summary of a failed rank: the rank's own line before it says why
WRAPPERS = ("ChildFailedError",)


# a crash in native code, as faulthandler writes it (every role runs with PYTHONFAULTHANDLER:
# launch/roles.py child_env), then the crashed thread's frames, innermost first
FATAL = re.compile(r"^(?:\[rank\d+\]:\s*)?(Fatal Python error: .+)$")
FRAME = re.compile(r'^(?:\[rank\d+\]:\s*)?\s+File "(.+)", line (\d+) in (.+)$')
FRAMES_AFTER_FATAL = 8  # faulthandler: a blank line and the thread's header come first


def raised(line: str) -> str | None:
    """`Class: message` when `line` ends a Python traceback (not torchrun's wrapper), else None."""
    found = RAISED.match(line)
    if found is None or found.group(1).split(":", 1)[0].endswith(WRAPPERS):
        return None
    return found.group(1)


def cause_at(text: list[str], i: int) -> str | None:
    """The error line `text[i]` reports: a traceback's last line, or a fatal error (SIGSEGV,
    SIGABRT in native code) with the innermost Python frame of the thread it hit."""
    found = raised(text[i])
    if found is not None:
        return found
    fatal = FATAL.match(text[i])
    if fatal is None:
        return None
    frame = next(filter(None, map(FRAME.match, text[i + 1:i + 1 + FRAMES_AFTER_FATAL])), None)
    where = f" in {frame.group(3)} ({frame.group(1)}:{frame.group(2)})" if frame else ""
    return fatal.group(1) + where


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's last `lines` lines and, when the error it logged last is above them (a
    torchrun trainer's tail is its own summary of which rank failed), that error's line."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    start = max(len(text) - lines, 0)
    tail = text[start:]
    if not any(cause_at(text, i) for i in range(start, len(text))):
        cause = next(filter(None, (cause_at(text, i) for i in reversed(range(start)))), None)
        if cause is not None:
            tail.append(f"... the error it logged last, above those lines: {cause}")
    return "\n".join(tail)


@dataclass
class Role:
    name: str
    proc: Child
    log: Path
    ports: dict[str, int] = field(default_factory=dict)
    host: str = "127.0.0.1"
    restarts: int = 0
    """Restarts in place so far."""

    def info(self) -> dict:
        return {"name": self.name, "host": self.host, "pid": self.proc.pid,
                "ports": self.ports, "log": str(self.log), "restarts": self.restarts}

    def failure(self, what: str) -> RoleFailed:
        return RoleFailed(
            f"role '{self.name}' {what}; its log is {self.log}. Last lines:\n{log_tail(self.log)}"
        )


class ProcessSet:
    """The processes one run started, by role name."""

    def __init__(self, log_dir: Path, env: dict[str, str], zygote: Zygote | None = None
                 ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.zygote = zygote
        """Forks our Python roles (runtime/zygote.py); None: each starts as its own process."""
        self.roles: list[Role] = []
        self.outside: dict[str, dict] = {}
        """Roles of the run that are not processes of this set (engines in Slurm jobs of
        their own, launch/engine_job.py), by name: their roles.json entries."""

    def start(self, name: str, cmd: list[str], *, ports: dict[str, int] | None = None,
              host: str = "127.0.0.1", cpus: list[int] | None = None) -> Role:
        log = self.log_dir / f"{name}.log"
        role = Role(name=name, proc=self._launch(cmd, log, cpus), log=log, ports=ports or {},
                    host=host)
        self.roles.append(role)
        return role

    def order(self, names: list[str]) -> None:
        """Keep the roles in the order of `names` whatever order they started in: the run's
        own (broker, engines, worker, trainer), so that `check_alive` reports the first role
        that exited in it, the one the others depend on."""
        self.roles.sort(key=lambda role: names.index(role.name))

    def restart(self, role: Role, cmd: list[str], cpus: list[int] | None = None) -> None:
        """Start `role` again (same name, log and ports) after its process died; orphans of
        its dead processes (in no other live role's sessions) are stopped with it."""
        tree = descendants(role.proc.pid)
        _signal_session(role.proc, signal.SIGKILL)  # whatever it left in its session
        _signal_each(tree, signal.SIGKILL)
        _reap(role.proc, timeout_s=5.0)
        others = [r for r in self.roles if r is not role and r.proc.poll() is None]
        self._stop_orphans(spare=_sessions(others))
        with role.log.open("ab") as f:
            f.write(f"\n--- relax-train: restarting {role.name} in place ---\n".encode())
        role.proc = self._launch(cmd, role.log, cpus)
        role.restarts += 1

    def _launch(self, cmd: list[str], log: Path, cpus: list[int] | None) -> Child:
        """`cmd` in a session of its own, its output appended to `log`: forked by the zygote
        when there is one and `cmd` is one of our Python modules, else a process of its own."""
        with log.open("ab") as f:  # the child holds its own descriptor (or opens its own)
            if self.zygote is not None:
                forked = self.zygote.fork(cmd, self.env, log, cpus)
                if forked is not None:
                    return forked
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True,
                                    preexec_fn=child_setup(os.getpid(), cpus))

    def stop(self, role: Role, grace_s: float = 10.0) -> None:
        """Stop one role for good (an engine a scale-in removed): SIGTERM, then SIGKILL after
        `grace_s`; it leaves the set, so `check_alive` no longer reports it."""
        tree = descendants(role.proc.pid)
        _signal_session(role.proc, signal.SIGTERM)
        _signal_each(tree, signal.SIGTERM)
        try:
            role.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_session(role.proc, signal.SIGKILL)
        _signal_each(tree, signal.SIGKILL)
        _reap(role.proc, timeout_s=5.0)
        self.roles.remove(role)

    def check_alive(self, exclude: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
        """Raise RoleFailed for the first role that exited (roles in `exclude` may exit 0;
        roles in `skip` are the caller's to check)."""
        for role in self.roles:
            if role.name in skip:
                continue
            rc = role.proc.poll()
            if rc is None:
                continue
            if role.name in exclude and rc == 0:
                continue
            raise role.failure(f"exited with code {rc}")

    def close(self) -> None:
        """SIGTERM every session, wait, then SIGKILL what is left, descendants in sessions of
        their own included (torchrun's ranks)."""
        trees = {role.name: descendants(role.proc.pid) for role in self.roles}
        for role in reversed(self.roles):
            _signal_session(role.proc, signal.SIGTERM)
            _signal_each(trees[role.name], signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for role in self.roles:
            try:
                role.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for role in self.roles:
            _signal_session(role.proc, signal.SIGKILL)  # stragglers in the session, too
            _signal_each(trees[role.name], signal.SIGKILL)
            _reap(role.proc, timeout_s=5.0)
        self._stop_orphans(spare=set())

    def _stop_orphans(self, spare: set[int]) -> None:
        """SIGKILL and reap the orphans this launcher adopted (`adopt_orphans`) outside the
        sessions in `spare` and its own (its own short-lived commands: sbatch, scontrol).
        A process that adopts none (a set used inside another program: a test's) has only
        children it started itself, which are not this set's to kill."""
        if not adopts_orphans():
            return
        role_pids = {r.proc.pid for r in self.roles}
        spare = spare | {os.getsid(0)}
        for pid in children(os.getpid()):
            if pid in role_pids or _session(pid) in spare:
                continue
            _signal_each(descendants(pid) + [pid], signal.SIGKILL)
            _reap_pid(pid, timeout_s=5.0)  # bounded: one stuck in the kernel must not hang us


def _reap_pid(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)


def _reap(proc: Child, timeout_s: float) -> None:
    """Wait for a SIGKILLed child without ever raising: teardown runs in `finally` and must not
    replace the error (or the Ctrl-C) that brought it there.

    A KeyboardInterrupt raised by a signal handler while `Popen.poll` held its private waitpid
    lock leaves that lock taken, and every later `Popen.wait` then times out (seen in CI:
    Ctrl-C exited 1 instead of 130). `os.waitpid` reaps the child regardless of that lock.
    """
    try:
        proc.wait(timeout=timeout_s)
        return
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first), from /proc. Taken before a role is
    stopped: once their parent is gone, orphans belong to init and cannot be found this way."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name (field 2) may hold spaces and parentheses: split after it
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def children(pid: int) -> list[int]:
    """The live children of `pid` (zombies included), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _stat(int(entry.name), 1) == pid:
            out.append(int(entry.name))
    return out


def _stat(pid: int, field: int) -> int | None:
    """Field `field` counted after the command name of /proc/PID/stat (1: the parent, 3: the
    session), split after the name, which may hold spaces and parentheses; None if gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[field])
    except (OSError, IndexError, ValueError):
        return None


def _session(pid: int) -> int | None:
    return _stat(pid, 3)


def _sessions(roles: list[Role]) -> set[int]:
    """The sessions the live processes of `roles` are in (torchrun's ranks: one each)."""
    out = set()
    for role in roles:
        for pid in [role.proc.pid] + descendants(role.proc.pid):
            sid = _session(pid)
            if sid is not None:
                out.add(sid)
    return out


def _signal_each(pids: list[int], sig: int) -> None:
    """`sig` to each process, and SIGCONT after a SIGTERM: a stopped process (SIGSTOP, a frozen
    rank) handles nothing until continued, and torchrun's ranks live in sessions of their own,
    out of reach of the role's killpg; left stopped, one outlived its run (seen in the suite)."""
    for pid in pids:
        for s in (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,):
            try:
                os.kill(pid, s)
            except (ProcessLookupError, PermissionError):
                pass


def _signal_session(proc: Child, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
