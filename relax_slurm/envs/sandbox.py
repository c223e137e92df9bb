"""Run a Python snippet in a child process with time, memory and output limits.

    result = await run_python("print(2 ** 10)", timeout_s=5, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out

The snippet runs in a fresh `python -I` (isolated: no user site, no PYTHONPATH, no current
directory on sys.path) in a temporary directory that is deleted afterwards, with an empty
environment, in its own session (so the whole process group is killed at the time limit), and
under rlimits set before the snippet's first line: address space (`memory_mb`), CPU seconds,
file size (1 MB) and core dumps (none). Output past `max_output_bytes` is read and thrown away
(the snippet cannot fill the worker's memory), and marked truncated.

This bounds what a runaway snippet costs; it is not a security boundary against hostile code
(the snippet can still read files and open sockets as the worker's user). Run the rollout
worker in a container or under a dedicated user when the policy may produce hostile code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

# Applied in the child before the snippet runs; the snippet arrives on stdin.
_BOOT = r"""
import resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
if mem > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
del resource, mem, cpu, fsize
sys.argv = ["<snippet>"]
exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
FILE_SIZE_LIMIT = 1 << 20
CHUNK = 1 << 16


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit code; negative: killed by that signal; None: killed at the limit."""
    timed_out: bool = False
    truncated: bool = False
    """Output past max_output_bytes was dropped."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Everything up to `cap` bytes; the rest is read and dropped (the child never blocks)."""
    kept, dropped = bytearray(), False
    while True:
        chunk = await stream.read(CHUNK)
        if not chunk:
            return bytes(kept), dropped
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            dropped = True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_bytes: int = 16384, python: str = sys.executable
                     ) -> SandboxResult:
    """Run `code` and return its output; never raises for what the snippet does."""
    cpu_s = max(1, int(timeout_s + 0.999))
    with tempfile.TemporaryDirectory(prefix="relax_sandbox_") as cwd:
        proc = await asyncio.create_subprocess_exec(
            python, "-I", "-c", _BOOT, str(memory_mb * 2**20), str(cpu_s), str(FILE_SIZE_LIMIT),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=cwd,
            env={"PATH": os.defpath, "HOME": cwd, "TMPDIR": cwd, "PYTHONIOENCODING": "utf-8",
                 "OMP_NUM_THREADS": "1"},
            start_new_session=True)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

        async def feed() -> None:
            try:
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):  # it exited without reading
                pass

        io = asyncio.gather(feed(), _read_capped(proc.stdout, max_output_bytes),
                            _read_capped(proc.stderr, max_output_bytes), proc.wait())
        timed_out = False
        try:
            _, (out, out_cut), (err, err_cut), status = await asyncio.wait_for(io, timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            _kill_group(proc.pid)
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            timed_out, out, err, out_cut, err_cut, status = True, b"", b"", False, False, None
        finally:
            _kill_group(proc.pid)  # children it forked, if any, go with it
    # a busy loop spends its CPU limit (ceil(timeout_s) s) as fast as the wall clock: the
    # kernel's SIGXCPU (soft limit) or SIGKILL (hard, a second later) can come first
    if status in (-signal.SIGXCPU, -signal.SIGKILL):
        timed_out = True
    return SandboxResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                         exit_code=status, timed_out=timed_out, truncated=out_cut or err_cut)
