"""Where the test suite's CPU goes: a pytest plugin and its report (docs/development.md).

The suite is CPU-bound on 2 cores (two xdist workers, each end-to-end test a tree of
processes), so its wall time falls only with the CPU its tests burn, which a loaded machine
does not change the way it changes wall time. Each test's row: its wall time and the CPU of
the pytest process and of every child it reaped (RUSAGE_CHILDREN: the launcher, which reaps
its roles, which reap theirs; orphans the launcher adopts count when it reaps them).

    PYTHONPATH=tools CPU_PROFILE_DIR=/tmp/cpu python -m pytest -p suite_cpu   # rows per worker
    python tools/suite_cpu.py /tmp/cpu                                         # CPU per file

The report also gives each worker's busy time and when it ended: the tail where one worker
has finished and the other runs alone.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest


def _cpu_s() -> float:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One JSON row per test (setup, call and teardown together: a module fixture's run is
    charged to the first test that needs it)."""
    t0, c0 = time.time(), _cpu_s()
    yield
    out = Path(os.environ.get("CPU_PROFILE_DIR", "cpu_profile"))
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(out / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps({"id": item.nodeid, "worker": worker, "start": t0,
                            "wall_s": time.time() - t0, "cpu_s": _cpu_s() - c0}) + "\n")


def per_file(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """(file, CPU s, wall s, tests), most CPU first."""
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0] += r["cpu_s"]
        f[1] += r["wall_s"]
        f[2] += 1
    return sorted(((k, *v) for k, v in files.items()), key=lambda t: -t[1])


def per_worker(rows: list[dict]) -> list[tuple[str, float, float, float]]:
    """(worker, busy s, first start, last end): a worker that ends long before the others
    leaves its core to them (the schedule's tail, docs/development.md)."""
    workers: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    return sorted((w, sum(r["wall_s"] for r in rs), min(r["start"] for r in rs),
                   max(r["start"] + r["wall_s"] for r in rs)) for w, rs in workers.items())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    rows = [json.loads(line) for p in sorted(Path(argv[0]).glob("*.jsonl"))
            for line in p.read_text().splitlines()]
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU-s in all")
    if all("start" in r for r in rows):
        begin = min(r["start"] for r in rows)
        for worker, busy, first, last in per_worker(rows):
            print(f"{worker}: busy {busy:7.1f} s, from {first - begin:6.1f} s to "
                  f"{last - begin:7.1f} s")
    for name, cpu, wall, n in per_file(rows):
        print(f"{cpu:8.1f} CPU-s {wall:8.1f} wall-s {n:4d} tests  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
