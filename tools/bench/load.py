"""The machine's load during a benchmark: how many cores *other* processes kept busy.

Every figure is a ratio of two measurements of one invocation, but load from elsewhere (a test
run, a build, another user) does not hit both sides alike: on a 2-core machine one busy
foreign process moved the long-tail ratio by 20-50% between two runs of one commit. The load
average cannot tell that load from the benchmark's own processes, so this counts CPU time
from /proc instead: the whole machine's busy time (/proc/stat) minus that of the bench process
and its descendants (/proc/<pid>/stat, with the time of children they already reaped), per
second of wall time = the foreign cores busy.

    with ForeignLoad() as load:
        ...
    load.summary()  # {"mean_cores": .., "max_cores": .., "samples": ..}

Linux only (/proc); elsewhere the summary says so and nothing is refused.

Load is not the only way the machine changes under a run: a shared VM also runs ~30% slower
for minutes at a time with nothing of its own running and no steal counted (session 41: TRL's
first 40 steps took 103-144 ms a step in a full run and 133-197 ms in a quick one minutes
later), which moves figures between invocations though each is a ratio. So each part also
times a fixed piece of CPU work at its start and at its end (`speed_probe`): a part whose two
probes differ by more than DRIFT is marked drifted, and two runs' probes of one part say
whether their disagreement is the machine's (report.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# a run whose foreign load averaged more than this many cores is marked loaded: a quarter of
# a core is about what made the same commit's ratios differ by more than 10% on 2 cores
LOADED_CORES = 0.25
# a part whose probe at its end differs from the one at its start by more than this share is
# marked drifted: the machine's own speed moved by more than the 10% two runs must agree within
DRIFT = 0.10


def machine_busy_s(stat: str) -> float:
    """Busy CPU seconds of the whole machine from /proc/stat's text (its first "cpu" line:
    user nice system idle iowait irq softirq steal ...; idle and iowait are not busy)."""
    fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already counted in user/nice
    return (sum(fields[:8]) - idle) / TICK


def parse_pid_stat(text: str) -> tuple[int, float]:
    """(ppid, CPU seconds of the process and of the children it reaped) from /proc/<pid>/stat
    (the command name, field 2, may hold spaces and parentheses: split after its last ')')."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14-17
    ppid = int(rest[1])
    utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
    return ppid, (utime + stime + cutime + cstime) / TICK


def tree_cpu_s(procs: dict[int, tuple[int, float]], root: int) -> float:
    """CPU seconds of `root` and every live descendant, from {pid: (ppid, cpu_s)}."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            total += procs[pid][1]
        todo += children.get(pid, [])
    return total


def snapshot(root: int) -> tuple[float, float, float]:
    """(monotonic time, the machine's busy CPU s, the tree of `root`'s CPU s)."""
    procs: dict[int, tuple[int, float]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                procs[int(entry.name)] = parse_pid_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                pass  # exited while we read
    busy = machine_busy_s((PROC / "stat").read_text())
    return time.monotonic(), busy, tree_cpu_s(procs, root)


def foreign_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores kept busy by processes outside the tree between two snapshots. A descendant that
    exited unreaped between them loses its last interval (it counts as foreign for it), so a
    small negative or positive error is clipped at 0."""
    dt = after[0] - before[0]
    if dt <= 0:
        return 0.0
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / dt)


def speed_probe(repeats: int = 3) -> float:
    """Seconds of one fixed piece of single-threaded CPU work (small matrix products and a
    Python loop, the two kinds of work a tiny step is made of), the best of `repeats`: lower
    is a faster machine. ~0.1 s a repeat."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((64, 64)) / 8.0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = a
        for _ in range(1500):
            x = np.tanh(x @ a)
        total = 0
        for i in range(1_000_000):
            total += i & 7
        best = min(best, time.perf_counter() - t0)
    return best


def drifted(start: float, end: float) -> bool:
    """Whether the machine's speed moved by more than DRIFT between two probes."""
    return abs(end / start - 1.0) > DRIFT


def summarize(xs: list[float]) -> dict:
    mean = sum(xs) / len(xs) if xs else 0.0
    return {"available": True, "samples": len(xs), "mean_cores": mean,
            "max_cores": max(xs, default=0.0), "loaded": mean > LOADED_CORES}


class ForeignLoad:
    """Samples the foreign load every `interval_s` in a thread while entered; `part(name)`
    starts a named span (the previous one ends there) and runs `probe` (speed_probe) at its
    start, exit runs it once more after the last; `parts()` summarizes each span."""

    def __init__(self, interval_s: float = 2.0, root: int | None = None,
                 probe: Callable[[], float] | None = speed_probe) -> None:
        self.interval_s = interval_s
        self.root = os.getpid() if root is None else root
        self.probe = probe
        self.probes: list[float] = []  # at each span's start, then once after the last
        self.samples: list[float] = []
        self.times: list[float] = []  # each sample's end (monotonic)
        self.spans: list[tuple[str, float]] = []
        self.available = (PROC / "stat").exists()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def part(self, name: str) -> None:
        if self.probe is not None:  # (before the span starts: its time is no part's)
            self.probes.append(self.probe())
        self.spans.append((name, time.monotonic()))

    def parts(self) -> dict[str, dict]:
        """{span: summary of the samples that ended inside it, with the probes at its start
        and end (`probe_s`, seconds) and whether they differ by more than DRIFT}."""
        if not self.available:
            out = {name: {"available": False} for name, _ in self.spans}
        else:
            ends = [t for _, t in self.spans[1:]] + [float("inf")]
            out = {name: summarize([x for x, t in zip(self.samples, self.times)
                                    if t0 < t <= t1])
                   for (name, t0), t1 in zip(self.spans, ends)}
        for i, (name, _) in enumerate(self.spans):
            if i + 1 < len(self.probes):
                start, end = self.probes[i], self.probes[i + 1]
                out[name] |= {"probe_s": [start, end], "drifted": drifted(start, end)}
        return out

    def __enter__(self) -> ForeignLoad:
        if self.available:
            self._thread = threading.Thread(target=self._run, daemon=True, name="foreign-load")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.probe is not None and self.spans and len(self.probes) == len(self.spans):
            self.probes.append(self.probe())  # the last span's end

    def _run(self) -> None:
        last = snapshot(self.root)
        while not self._stop.wait(self.interval_s):
            now = snapshot(self.root)
            self.samples.append(foreign_cores(last, now))
            self.times.append(now[0])
            last = now

    def summary(self) -> dict:
        return summarize(self.samples) if self.available else {"available": False}


def idle_check(seconds: float = 6.0, interval_s: float = 1.0) -> dict:
    """The foreign load over `seconds` before anything starts (the bench refuses to begin on
    a loaded machine unless told to go on: run.py --allow-load)."""
    with ForeignLoad(interval_s) as load:
        time.sleep(seconds)
    return load.summary()
