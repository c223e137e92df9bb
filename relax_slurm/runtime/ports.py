"""Free TCP ports for roles that bind them later: the launcher's plan, a re-formed weight-sync
group, an elastic engine.

A port is chosen here and bound by another process seconds, or for an SGLang server tens of
seconds, later; until then "free now" is all anyone knows of it. Three kinds of process can take
it in between, and each has cost a run:

- this process: a plan asks for every port before any role binds one, so the same free port
  came back twice (two roles of one run, one failed to bind): `_HANDED_OUT`;
- the OS, for outgoing connections (HTTP clients, gloo, ZMQ) from the ephemeral range: ports are
  drawn below it (a broker once lost its admin port that way);
- another process on this host choosing the same way at the same moment: another run's
  launcher, a second test worker, and SGLang itself, which since 0.5.22 draws its scheduler's
  torch.distributed port from 22000-29999 (`get_free_port_below_ephemeral`) and binds it at
  once, while our engine's HTTP port is bound only at the end of its start (seen in CI: an
  SGLang server of the VL parity test found its port taken 24 s after it was chosen). Ports are
  drawn below 22000, and every port handed out on this host is recorded for `RESERVE_S` in one
  small file under the temp directory, locked while it is read and written
  (`RELAX_PORTS_FILE`), so that no other relax-slurm process hands it out in that time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOW = 10000
SGLANG_LOW = 22000
"""SGLang 0.5.22+ draw the scheduler's port (`nccl_port`) from [22000, 29999]: kept clear."""
RESERVE_S = 600.0
"""How long a port handed out stays reserved host-wide: longer than any role's start (an
SGLang server's health wait is 300 s at most) takes to bind it."""
PORTS_FILE_ENV = "RELAX_PORTS_FILE"

# Ports this process has handed out (kept for the process's life, not only RESERVE_S).
_HANDED_OUT: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def draw_range() -> tuple[int, int]:
    """[low, high) that ports are drawn from: below the ephemeral range and SGLang's own."""
    lo, _ = ephemeral_range()
    return LOW, min(lo, SGLANG_LOW)


def ports_file() -> Path:
    env = os.environ.get(PORTS_FILE_ENV)
    return Path(env) if env else Path(tempfile.gettempdir()) / f"relax_slurm-ports-{os.getuid()}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and handed out by no relax-slurm process on this host in the
    last RESERVE_S seconds (nor ever by this one), below the ephemeral range and SGLang's."""
    low, high = draw_range()
    rng = random.SystemRandom()
    if high - low >= 2000:
        with _reservations() as reserved:
            for _ in range(256):
                port = rng.randrange(low, high)
                if port not in _HANDED_OUT and port not in reserved and _bindable(host, port):
                    _HANDED_OUT.add(port)
                    reserved[port] = time.time()
                    return port
    for _ in range(256):  # no room below the ephemeral range: the OS's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free TCP port on {host}")


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The host's recent hand-outs as {port: time}, under an exclusive lock on the file; written
    back (without the expired ones) on exit. A file that cannot be opened or locked (a read-only
    temp directory, NFS without locks) leaves only this process's own memory of its ports."""
    try:
        f = open(ports_file(), "a+")
    except OSError:
        yield {}
        return
    with f:  # closing the file releases the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield {}
            return
        f.seek(0)
        cutoff, ports = time.time() - RESERVE_S, {}
        for line in f.read().splitlines():
            try:
                port, at = line.split()
                if float(at) > cutoff:
                    ports[int(port)] = float(at)
            except ValueError:
                continue  # a torn or foreign line: ignored, dropped on write-back
        yield ports
        try:
            f.seek(0)
            f.truncate()
            f.write("".join(f"{p} {t:.3f}\n" for p, t in ports.items()))
        except OSError:
            pass  # a full disk: the port handed out stands, the host file just misses it


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
