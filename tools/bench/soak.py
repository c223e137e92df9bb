"""A long run that must stay flat (issue #35): memory, open files and threads per role, the
reward, the step time, from warm-up to the end.

    python tools/bench/soak.py [--steps 2000] [--warm 200] [--experiment tiny_cpu] [--out soak_out]

Runs `relax-train experiment=EXPERIMENT algo.max_staleness=1` for `--steps` steps (the preset
builds its own tiny model and data) and samples every role's process tree from /proc every
`--every-s` seconds: resident memory (VmRSS), open file descriptors and threads, summed over
the tree (the trainer's torchrun agent and its ranks; an engine's server and its children).
Reports per role the figures at the first sample after step `--warm` (after warm-up) and at
the end, and their growth; the reward per tenth of the run; the median step time of the
steps right after warm-up against the last ones. Goal: no role grows more than 10% after
warm-up, the reward holds, the step time stays within 10%. Writes OUT/soak.json and prints a
markdown table for docs/benchmarks.md. A benchmark run on demand, not a test (Linux: /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _usage(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open fds, threads) of one process, None if gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return rss, fds, int(fields.get("Threads", "0").strip())


def sample(run_dir: Path) -> dict[str, dict[str, int]]:
    """Per role of roles.json: its process tree's RSS, fds, threads."""
    try:
        rows = json.loads((run_dir / "roles.json").read_text())
    except (OSError, ValueError):
        return {}
    kids, out = _children(), {}
    for row in rows:
        if not isinstance(row.get("pid"), int):
            continue
        used = [u for u in map(_usage, _tree(row["pid"], kids)) if u is not None]
        if used:
            out[row["name"]] = {"rss": sum(u[0] for u in used), "fds": sum(u[1] for u in used),
                                "threads": sum(u[2] for u in used), "procs": len(used)}
    return out


def steps_done(run_dir: Path) -> int:
    try:
        with (run_dir / "metrics.jsonl").open() as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def growth(first: dict, last: dict) -> dict[str, float]:
    return {k: (last[k] - first[k]) / first[k] if first[k] else 0.0
            for k in ("rss", "fds", "threads")}


def summarize(samples: list[dict], rows: list[dict], warm: int) -> dict:
    # from warm-up to the last sample with every role of the first up (not the shutdown)
    after = [s for s in samples if warm <= s["step"] < len(rows) and s["roles"]]
    first = after[0]
    last = [s for s in after if s["roles"].keys() >= first["roles"].keys()][-1]
    roles = {}
    for name in sorted(set(first["roles"]) & set(last["roles"])):
        a, b = first["roles"][name], last["roles"][name]
        roles[name] = {"at_step": first["step"], "first": a, "last_step": last["step"],
                       "last": b, "growth": growth(a, b)}
    tenth = max(1, len(rows) // 10)
    reward = [statistics.mean(r["rollout/reward_mean"] for r in rows[i:i + tenth])
              for i in range(0, len(rows), tenth)]
    times = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r]
    window = min(100, max(1, (len(times) - warm) // 2))
    early = statistics.median(times[warm:warm + window])
    late = statistics.median(times[-window:])
    return {"roles": roles, "reward_per_tenth": reward,
            "step_time_s": {"after_warmup": early, "end": late, "drift": late / early - 1},
            "steps": len(rows)}


def table(result: dict) -> str:
    lines = ["| role | RSS MB (warm -> end) | growth | fds | threads |", "|---|---|---|---|---|"]
    for name, r in result["roles"].items():
        a, b, g = r["first"], r["last"], r["growth"]
        lines.append(f"| {name} | {a['rss'] / 2**20:.0f} -> {b['rss'] / 2**20:.0f} | "
                     f"{g['rss']:+.1%} | {a['fds']} -> {b['fds']} | "
                     f"{a['threads']} -> {b['threads']} |")
    st = result["step_time_s"]
    lines += ["", f"step time {st['after_warmup']:.3f} s after warm-up, {st['end']:.3f} s at the "
              f"end ({st['drift']:+.1%}); reward per tenth of the run: "
              + " ".join(f"{x:.2f}" for x in result["reward_per_tenth"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warm", type=int, default=200)
    p.add_argument("--experiment", default="tiny_cpu")
    p.add_argument("--every-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("soak_out"))
    p.add_argument("overrides", nargs="*", help="more relax-train overrides")
    args = p.parse_args(argv)
    run_dir = (args.out / f"{args.experiment}_{args.steps}").resolve()
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli", f"experiment={args.experiment}",
           f"run_dir={run_dir}", "algo.max_staleness=1", f"trainer.total_steps={args.steps}",
           "metrics.progress=false", *args.overrides]
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"{args.experiment}_{args.steps}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    samples, t0 = [], time.monotonic()
    try:
        while proc.poll() is None:
            samples.append({"t": time.monotonic() - t0, "step": steps_done(run_dir),
                            "roles": sample(run_dir)})
            time.sleep(args.every_s)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
    if proc.returncode != 0:
        print(f"relax-train failed ({proc.returncode}); see {log.name}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = summarize(samples, rows, args.warm) | {"command": " ".join(cmd),
                                                    "wall_s": time.monotonic() - t0}
    (args.out / "soak.json").write_text(json.dumps({"summary": result, "samples": samples}))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
