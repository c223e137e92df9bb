"""Local roles forked from one process that imported torch and transformers once: the zygote.

Every role of a local run is a Python process that starts by importing torch, transformers,
uvicorn and our modules: ~3 CPU-s for an hf engine, ~1.5 for the rollout worker and for
torchrun's agent, paid again by each one, and on a small machine the roles' imports compete for
the same cores (docs/development.md, session 47). The zygote (`python -m
relax_slurm.runtime.zygote ROLE=MODULE,...`, started by the local runner while it still
checks the run's inputs) imports those modules once, then forks a role for each request: the
fork inherits the imports and goes straight to its own work. torchrun's agent, itself forked
so, forks its ranks from a zygote of its own (`Zygote.fork_here`, runtime/torchrun.py).

A forked role is the same program a fresh one is: `python -m MODULE ARGS` run by `runpy` in a
child that first takes its session, its log as stdout and stderr, /dev/null as stdin, its
environment, its CPUs and its title (`setproctitle`: `ps` and /proc/PID/cmdline show the
command it stands for). It is forked twice so that it becomes a child of the launcher (which
is a child subreaper, runtime/lifetime.py `adopt_orphans`; for a rank, of the agent):
`ProcessSet` (torchrun) waits for it, signals its session and reaps it as it does a `Popen`'s
child (`Forked`), and it dies with the launcher (PR_SET_PDEATHSIG), not with the zygote.

Only where it is safe and only as a speed-up: on a machine with a GPU, and on Slurm, every
role starts as its own process (a CUDA driver touched before a fork is undefined in the
child), and so does any command that is not one of the roles it was told of (SGLang's
server); a zygote that died leaves the roles after it to start as processes of their own;
`cluster.fork_roles=false` turns it off.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from relax_slurm.errors import RoleFailed
from relax_slurm.runtime.lifetime import child_setup, die_with

REPLY_TIMEOUT_S = 300.0
"""How long a request may wait for the zygote: its first waits for the imports (seconds; a
minute on a loaded 2-core machine), a fork takes milliseconds."""
ADOPT_TIMEOUT_S = 10.0
FORKED_ENV = "RELAX_FORKED_ROLE"
"""Set in a role the zygote forked: torchrun's agent then forks its ranks too
(runtime/torchrun.py)."""


def use_zygote(fork_roles: bool) -> bool:
    """Whether a local run forks its roles: asked for, on Linux, with no GPU on the machine."""
    gpu = any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/kfd"))
    return fork_roles and sys.platform.startswith("linux") and not gpu


def model_code(model_path: str) -> list[str]:
    """transformers' modeling module for the model at `model_path` (its config.json's
    model_type), for a zygote to import: [] when it names none."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f"transformers.models.{model_type}.modeling_{model_type}"]


def module_and_args(cmd: list[str]) -> tuple[str | None, list[str]]:
    """(MODULE, ARGS) when `cmd` is `<this python> [-u] -m MODULE ARGS`, else (None, [])
    (-u: the zygote's roles write unbuffered already, their environment has
    PYTHONUNBUFFERED)."""
    head = [cmd[0], *(a for a in cmd[1:2] if a == "-u")] if cmd else []
    rest = cmd[len(head):]
    if cmd[:1] == [sys.executable] and len(rest) >= 2 and rest[0] == "-m":
        return rest[1], rest[2:]
    return None, []


class Forked:
    """A role the zygote forked, adopted by this process: `subprocess.Popen`'s `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate` and `kill`, from `os.waitpid`."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # reaped by someone else: gone, its status unknown. Popen says 0 here; a role
                # that may have crashed must not read as one that finished, so: killed
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A handle on a zygote process: `start` runs one (the local launcher's), `fork_here`
    makes one of a fork of this process (torchrun's agent's, for its ranks). `fork` returns a
    `Forked` process, or None when the zygote cannot (the caller then starts it itself)."""

    def __init__(self, proc: subprocess.Popen | Forked, requests, replies,
                 roles: list[str]) -> None:
        self.proc, self.requests, self.replies = proc, requests, replies
        self.alive = True
        self.roles = set(roles)
        """The modules it forks roles of; any other command (SGLang's server, a user's
        script) starts as a process of its own."""

    @classmethod
    def start(cls, imports: dict[str, list[str]], env: dict[str, str]) -> Zygote:
        """A zygote in a Python of its own that imports `imports` (launch/roles.py
        `role_imports`): the modules each role imports, by the module it runs, in the order
        the roles start."""
        # the roles' environment from the start: some modules read theirs at import
        # (OMP_NUM_THREADS, HF_HUB_OFFLINE); stderr nowhere: a failed import is the role's
        # to report, in its own log, when it imports the module itself
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__,
             *(f"{role}={','.join(modules)}" for role, modules in imports.items())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            preexec_fn=child_setup(os.getpid(), None))
        return cls(proc, proc.stdin, proc.stdout, list(imports))

    @classmethod
    def fork_here(cls, imports: dict[str, list[str]], title: str) -> Zygote:
        """This process, forked, as a zygote that imports `imports` on top of what this one has
        imported, titled `title` in `ps`. Call it before this process starts a thread. The
        processes it forks keep this one's stdout and stderr (`fork(..., log=None)`)."""
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(requests_w)
                os.close(replies_r)
                die_with(parent)
                import setproctitle  # not at the top: the launcher never needs it
                setproctitle.setproctitle(title)
                _zygote_main(list(imports.items()), requests_r, replies_w)
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        return cls(Forked(pid, ["zygote"]), os.fdopen(requests_w, "wb"),
                   os.fdopen(replies_r, "rb"), list(imports))

    def fork(self, cmd: list[str], env: dict[str, str], log: Path | None,
             cpus: list[int] | None) -> Forked | None:
        """`cmd` forked: its output appended to `log` (None: this process's stdout and
        stderr), `env` its environment, pinned to `cpus`; None if the zygote cannot."""
        module, args = module_and_args(cmd)
        if module not in self.roles or not self.alive:
            return None
        request = {"module": module, "args": args, "title": " ".join(cmd), "env": env,
                   "log": str(log) if log else None, "cwd": os.getcwd(), "cpus": cpus,
                   "parent": os.getpid()}
        try:
            self.requests.write(json.dumps(request).encode() + b"\n")
            self.requests.flush()
            ready, _, _ = select.select([self.replies], [], [], REPLY_TIMEOUT_S)
            line = self.replies.readline() if ready else None
        except OSError:
            line = b""
        if line is None:
            # not a fallback: the zygote may still fork it, and a second one of the same role
            # (a torchrun agent, a broker on the same port) must never run beside it
            self.close()
            raise RoleFailed(f"the zygote that forks this run's roles did not start "
                             f"'{' '.join(cmd)}' within {REPLY_TIMEOUT_S:.0f}s; run with "
                             "cluster.fork_roles=false to start every role as its own process")
        if not line:  # it died (it forks nothing more): this role and the next start on their own
            self.close()
            return None
        return Forked(int(json.loads(line)["pid"]), cmd)

    def close(self) -> None:
        """Stop the zygote at once (it may still be importing: a refused run must not wait for
        that); the processes it forked are not its own and live on."""
        self.alive = False
        self.proc.kill()
        self.proc.wait()
        for stream in (self.requests, self.replies):
            try:
                stream.close()
            except OSError:  # a request it never read: nobody is left to read it
                pass


# ---- the zygote process ------------------------------------------------------------------


def _preload(modules: list[str], role: str | None = None) -> None:
    """Import `modules` (`MODULE:FUNCTION` also calls FUNCTION(): an import the role makes
    through a function, as megatron's through cpu_compat.import_bridge); the `role`'s own
    module (or its package's `__main__`) for what it imports, then forgotten, as runpy runs it
    afresh in the role. Then freeze the heap: the forked roles' collections never walk the
    objects imported here, nor copy their pages."""
    for name in modules:
        module, _, function = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if function:
                getattr(loaded, function)()
        except Exception:  # noqa: BLE001 -- the role that needs it reports it, in its own log
            pass
    if role is not None:
        for name in (role, f"{role}.__main__"):
            if name in sys.modules and not hasattr(sys.modules[name], "__path__"):
                del sys.modules[name]
    gc.freeze()


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read byte-wise so nothing after it stays in a buffer the forked
    roles would inherit; b"" at EOF."""
    out = bytearray()
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


def _requests(fd: int, block: bool) -> list[dict] | None:
    """The next request on `fd` ([] when none is waiting and not `block`); None once the
    launcher has closed its end (it is gone, or done starting roles)."""
    if not block and not select.select([fd], [], [], 0)[0]:
        return []
    line = _read_line(fd)
    return [json.loads(line)] if line else None


def _fork_role(request: dict, fds: tuple[int, int]) -> None:
    """Fork the role `request` asks for and tell the launcher its pid (on `fds[1]`)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        # the middle child forks the role and leaves at once, so the role is orphaned and
        # adopted by the launcher, the child subreaper, instead of staying the zygote's
        os.close(r)
        role = os.fork()
        if role == 0:
            os.close(w)
            _become(request, fds)  # never returns
        os.write(w, str(role).encode())
        os._exit(0)
    os.close(w)
    pid = b""
    while chunk := os.read(r, 64):
        pid += chunk
    os.close(r)
    os.waitpid(middle, 0)
    os.write(fds[1], json.dumps({"pid": int(pid)}).encode() + b"\n")


def _zygote_main(groups: list[tuple[str, list[str]]], requests: int, replies: int) -> None:
    """Import each role's modules, in the order the launcher starts the roles, and fork a role
    as soon as its own are in: the first role does not wait for the last one's imports."""
    # Ctrl-C in the launcher's terminal reaches this process group: the zygote leaves when the
    # launcher closes its end, not on a signal meant for the launcher
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload(["setproctitle"])
    fds = (requests, replies)
    ready: set[str] = set()
    waiting: list[dict] = []
    for role, modules in groups:
        _preload(modules, role)
        ready.add(role)
        new = _requests(requests, block=False)
        if new is None:
            return
        waiting += new
        while waiting and waiting[0]["module"] in ready:
            _fork_role(waiting.pop(0), fds)
    for request in waiting:
        _fork_role(request, fds)
    while (new := _requests(requests, block=True)) is not None:
        _fork_role(new[0], fds)


def _become(request: dict, fds: tuple[int, int]) -> None:
    """Turn this forked child into `python -m MODULE ARGS` as the launcher would have started
    it (launch/processes.py `ProcessSet.start`), run it, and leave as an interpreter does."""
    code = 1
    try:
        parent = request["parent"]
        os.setsid()
        deadline = time.monotonic() + ADOPT_TIMEOUT_S
        while os.getppid() != parent:  # until the middle child is gone and the launcher adopted us
            if time.monotonic() > deadline:
                os._exit(1)  # the launcher is gone (or no subreaper): nobody would reap us
            time.sleep(0.001)
        die_with(parent)
        if request["cpus"]:
            os.sched_setaffinity(0, request["cpus"])
        os.chdir(request["cwd"])
        for fd in fds:  # the zygote's requests and replies: never the role's (nor a copy
            if fd > 2:  # kept open by it, which would hide the launcher's end closing)
                os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request["log"]:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        import setproctitle  # imported already (`_zygote_main`); not at the top: see above
        setproctitle.setproctitle(request["title"])  # before the environment changes: it
        os.environ.clear()  # finds the space for a title next to the original one
        os.environ.update(request["env"])
        os.environ[FORKED_ENV] = "1"
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["-m", *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 -- printed as the interpreter would, exit 1
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # what an interpreter does at its end: non-daemon threads,
        atexit._run_exitfuncs()  # then atexit
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    """`python -m relax_slurm.runtime.zygote ROLE=MODULE,MODULE ...`: the modules each role
    (by the module it runs) imports, in the order the launcher starts them; requests on
    stdin, replies on stdout."""
    groups = [(role, modules.split(",")) for role, modules in
              (arg.split("=", 1) for arg in sys.argv[1:])]
    _zygote_main(groups, 0, 1)


if __name__ == "__main__":
    main()
