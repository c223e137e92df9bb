"""`relax-train -m key=a,b ...`: a Hydra multirun, one run per point of the sweep.

Hydra's basic launcher calls relax-train's task once per point, in this process, one after
the other. Each point gets its own run directory, `run_dir/<num>_<swept values>`
(`hydra.sweep.dir` is `${run_dir}`, `hydra.sweep.subdir` names the point by the keys the
command line sweeps; conf/train.yaml). Locally a point runs to its end before the next starts;
with `cluster=slurm` a point is submitted as its own heterogeneous job and the next is submitted
at once (`cluster.wait=true` then waits for every job at the end).

A failing point does not stop the sweep: its error is recorded and the next point runs. The
sweep ends with a table of every point (overrides, run directory, job, state, reward), written to
`run_dir/sweep.json` as well, and exit status 1 if any point failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.types import RunMode

from relax_slurm.errors import ConfigError

SWEEP_FILE = "sweep.json"
MAX_NAME_CHARS = 120  # a directory name stays well under the usual 255-byte limit
OK_STATES = ("completed", "submitted", "dry run")


def is_multirun(argv: Sequence[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def fixed_keys(argv: Sequence[str]) -> list[str]:
    """Keys the command line sets to one value in every point (paths, the experiment, ...):
    left out of a point's directory name, which then shows only what the sweep varies."""
    args = [a for a in argv if not a.startswith("-") and "=" in a]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except OverrideParseException as e:
        raise ConfigError(f"{e} (Hydra's override grammar: key=a,b sweeps, key=range(0,3), "
                          "quote values with commas: key='[1,2]')") from e
    return sorted({o.key_or_group for o in overrides
                   if not o.is_sweep_override() and not o.is_hydra_override()})


def point_name(num: int, override_dirname: str) -> str:
    """`hydra.sweep.subdir` of a point: `<num>_<key=value,...>` (resolver `relax_point`).
    `/` in a value would nest directories, so it becomes `_`; long names are cut (the number
    keeps them apart)."""
    name = re.sub(r"[/\s]", "_", override_dirname)[:MAX_NAME_CHARS]
    return f"{num}_{name}" if name else str(num)


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@dataclass
class Point:
    """One point's outcome, a row of the table."""

    num: int
    overrides: str  # the point's swept values (hydra.job.override_dirname)
    run_dir: str
    state: str  # completed, failed, submitted, dry run; after a wait: the job's final state
    job_id: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.state in OK_STATES


def outcome(run_dir: Path) -> str:
    """A point's result for the table, from its summary.json: `reward_first -> reward_last`
    (an SFT point: its validation loss), `-` without a summary (failed, queued, dry run)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "-"
    for first, last, label in (("reward_first", "reward_last", ""),
                               ("val_loss_first", "val_loss_last", "val_loss ")):
        if summary.get(first) is not None and summary.get(last) is not None:
            return f"{label}{summary[first]:.3f} -> {summary[last]:.3f}"
    return "-"


class Sweep:
    """The points run so far in this process (Hydra's basic launcher runs them in order)."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.sweep_dir: Path | None = None
        self.waiting: list[tuple[Point, float]] = []  # cluster.wait: (point, poll period)

    def begin(self) -> Point:
        """The point Hydra is running now: its number, swept values and run directory."""
        hc = HydraConfig.get()
        self.sweep_dir = Path(hc.sweep.dir).resolve()
        point = Point(num=hc.job.num, overrides=hc.job.override_dirname or "(none)",
                      run_dir=str(Path(hc.runtime.output_dir).resolve()), state="running")
        self.points.append(point)
        return point

    def wait_jobs(self) -> None:
        """cluster.wait=true: wait for each submitted job in turn (they run concurrently, so
        the sweep takes as long as its longest job plus the queue)."""
        from relax_slurm.launch.sbatch import report_job

        for point, poll_s in self.waiting:
            assert point.job_id is not None
            status = report_job(point.job_id, Path(point.run_dir), poll_s)
            point.state, point.message = status["state"], status.get("message", "")

    def failed(self) -> list[Point]:
        return [p for p in self.points if not p.ok]

    def table(self) -> str:
        rows = [("#", "overrides", "run_dir", "job", "state", "reward")]
        rows += [(str(p.num), p.overrides, p.run_dir, p.job_id or "-", p.state,
                  outcome(Path(p.run_dir))) for p in self.points]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5] for r in rows]
        for p in self.points:
            if p.message and not p.ok:
                lines.append(f"#{p.num}: {p.message.splitlines()[0]}")
        n_failed = len(self.failed())
        lines.append(f"{len(self.points)} point(s), {n_failed} failed"
                     + (f"; sweep directory: {self.sweep_dir}" if self.sweep_dir else ""))
        return "\n".join(lines)

    def write(self) -> None:
        if self.sweep_dir is not None and self.sweep_dir.is_dir():
            (self.sweep_dir / SWEEP_FILE).write_text(
                json.dumps([asdict(p) for p in self.points], indent=2) + "\n")

    def exit_code(self) -> int:
        return 1 if self.failed() else 0
