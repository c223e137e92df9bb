"""Did a bench run get worse than a baseline? Every headline of two bench_results*.json, judged
on its repeats, not on its median alone.

    python tools/bench/compare.py BASELINE.json NEW.json [--tolerance 0.05]
    python tools/bench/run.py --quick --baseline bench_results_quick.json   # the same, at the end

A headline is a median of interleaved repeats whose min and max the results keep (common.spread).
Two runs of one commit move by their spread, so a change of the median says little; a change
that moved every repeat does. A figure has **regressed** when every new repeat lies on the worse
side of every baseline repeat (the new run's range entirely beyond the baseline's: with three
repeats on each side, a chance of 1 in 20 when nothing changed) *and* the medians differ by more
than the tolerance: relative for ratios; in their own units for the figures that sit near 0
(reward for the `*_delta` figures, step for the `*_share*` ones). **improved** is the same on
the better side; **same** otherwise. Which side is worse is the figure's target direction
(report.TARGETS). A figure measured with fewer than two repeats on either side, or by a part
that met foreign load (the results' `loaded`, load.py), gets no verdict: its change is shown,
marked so. Nor does one whose parts ran on a machine more than 10% faster or slower in one run
than in the other (the mean of each run's speed probes of those parts, load.py `speed_probe`):
a slowed host moves the two sides of a ratio unequally (docs/benchmarks.md, "What one commit's
two kinds of run say"), and every repeat of that run with it. A part whose machine drifted
within the run is judged, the mark beside the verdict: the drift fell on interleaved repeats of
both sides of its ratios and widened the range the verdict reads (on this VM nearly every part
of a run drifts by >10%).

Exit status: 1 when any headline regressed, 0 otherwise, 2 on bad input (a file that is not a
bench result, a quick run against a full one: their learning figures cover different lengths).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import drifted  # noqa: E402
from report import TARGETS, _find, _fmt, _parts_of, machine_ratio  # noqa: E402

TOLERANCE = 0.05
"""Relative: on this 2-core machine a ratio's median moves by a few percent between idle runs
of one commit whose repeats do not overlap (a drift of the machine between invocations, which
interleaving cannot cancel); docs/benchmarks.md's figures of one commit over sessions."""
DELTA_TOLERANCE = 0.05
"""Reward units: the reward deltas' own target band (async - sync >= -0.05)."""
SHARE_TOLERANCE = 0.005
"""Step units, for the `*_share*` figures (a part's time over the step's): 0.5% of a step. The
overlapped sync's exposed share sits at ~7e-5 of a step (~13 us, the timer's grain), where a
relative change says nothing."""


def absolute(figure: str) -> bool:
    """Whether a figure's change is judged in its own units rather than relative to it."""
    return figure.endswith("_delta") or "_share" in figure


@dataclass(frozen=True)
class Verdict:
    figure: str
    base: dict
    new: dict
    change: float | None
    """new - base (in its units) for a `*_delta` or `*_share*` figure, else new / base - 1;
    None unmeasured."""
    outcome: str
    """`judge`'s: regressed, improved, same, or why it could not judge (missing, one repeat,
    unknown figure)."""
    notes: tuple[str, ...] = ()
    """The marks of either run's part: foreign load or another machine speed (`withheld`), or
    a drift within the run (beside the outcome)."""
    withheld: bool = False
    """No verdict: a run's part met foreign load, or the two runs' machines differed."""

    @property
    def verdict(self) -> str:
        return ", ".join(self.notes if self.withheld else (self.outcome, *self.notes))

    @property
    def regressed(self) -> bool:
        return self.outcome == "regressed" and not self.withheld


def judge(figure: str, base: dict, new: dict, higher_is_better: bool, *,
          tolerance: float = TOLERANCE, delta_tolerance: float = DELTA_TOLERANCE,
          share_tolerance: float = SHARE_TOLERANCE) -> tuple[float | None, str]:
    """(change, verdict) of one figure from its two spread records ({min, median, max, n});
    pure: the marks of load and drift are the caller's."""
    b, n = base.get("median"), new.get("median")
    if not _finite(b) or not _finite(n):
        return None, "missing"
    if absolute(figure):
        band = delta_tolerance if figure.endswith("_delta") else share_tolerance
        change, big = n - b, abs(n - b) > band
    elif b == 0:
        return None, "missing"
    else:
        change = n / b - 1
        big = abs(change) > tolerance
    if min(base.get("n", 0), new.get("n", 0)) < 2:
        return change, "one repeat"
    lo_b, hi_b, lo_n, hi_n = base.get("min"), base.get("max"), new.get("min"), new.get("max")
    if not all(map(_finite, (lo_b, hi_b, lo_n, hi_n))):
        return change, "one repeat"  # a repeat that never reached its reward (inf)
    above, below = lo_n > hi_b, hi_n < lo_b  # every new repeat beyond every baseline one
    if big and (above or below):
        better = above if higher_is_better else below
        return change, "improved" if better else "regressed"
    return change, "same"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare(base: dict, new: dict, parts: set[str] | None = None, **tolerances: float
            ) -> list[Verdict]:
    """Every headline either run reports, in the baseline's order; with `parts`, only those
    measured by them (a `run.py --parts` run keeps the other parts' figures from before)."""
    figures = list(dict.fromkeys([*base.get("headline", {}), *new.get("headline", {})]))
    out = []
    for figure in figures:
        if parts is not None and not (figure in TARGETS and set(_parts_of(figure)) <= parts):
            continue
        if figure not in TARGETS:  # a figure of a newer or older bench: shown, not judged
            out.append(Verdict(figure, {}, {}, None, "unknown figure"))
            continue
        b, n = _find(base, figure), _find(new, figure)
        change, outcome = judge(figure, b, n, TARGETS[figure][1], **tolerances)
        if outcome in ("missing", "one repeat"):
            out.append(Verdict(figure, b, n, change, outcome))
            continue
        # foreign load, or a machine of another speed under every repeat of one run: no
        # verdict. A drift inside a part is judged: it lands on the repeats of both sides of
        # the ratio (interleaved) and widens the range it is judged by
        blocks = _marked("loaded", figure, base, new)
        speed = machine_ratio(base, new, figure)  # the new run's probe over the baseline's
        if speed is not None and drifted(1.0, speed):
            blocks.append(f"machine {speed:.2f}x slower (new)" if speed > 1
                          else f"machine {1 / speed:.2f}x faster (new)")
        notes = blocks or _marked("drifted", figure, base, new)
        out.append(Verdict(figure, b, n, change, outcome, tuple(notes), withheld=bool(blocks)))
    return out


def _marked(mark: str, figure: str, base: dict, new: dict) -> list[str]:
    """'MARK (baseline)' / 'MARK (new)' where that run lists a part of `figure` under `mark`."""
    return [f"{mark} ({which})" for which, res in (("baseline", base), ("new", new))
            if any(p in res.get(mark, ()) for p in _parts_of(figure))]


def _cell(rec: dict) -> str:
    lo, med, hi = rec.get("min"), rec.get("median"), rec.get("max")
    if not _finite(med):
        return "-"
    if not (_finite(lo) and _finite(hi) and rec.get("n", 0) >= 2):
        return _fmt(med)
    return f"{_fmt(med)} ({_fmt(lo)}-{_fmt(hi)})"


def table(verdicts: list[Verdict]) -> list[str]:
    lines = ["| figure | baseline: median (min-max) | new: median (min-max) | change | verdict |",
             "|---|---|---|---|---|"]
    for v in verdicts:
        change = "-" if v.change is None else (
            f"{v.change:+.3g}" if absolute(v.figure) else f"{v.change:+.1%}")
        mark = ", ".join(["**regressed**", *v.notes]) if v.regressed else v.verdict
        lines.append(f"| `{v.figure}` | {_cell(v.base)} | {_cell(v.new)} | {change} | {mark} |")
    return lines


def load_results(path: Path) -> dict:
    """A bench_results*.json, or ValueError naming the file and what is wrong with it."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(res, dict) or not isinstance(res.get("headline"), dict):
        raise ValueError(f"{path}: no 'headline' map: not a bench result (tools/bench/run.py "
                         "writes bench_results.json and bench_results_quick.json)")
    return res


def check_comparable(base: dict, new: dict, base_path: Path, new_path: Path) -> None:
    if bool(base.get("quick")) != bool(new.get("quick")):
        quick = new_path if new.get("quick") else base_path
        raise ValueError(f"{quick} is a --quick run and the other a full one: their learning "
                         "figures cover different lengths; compare a quick run with "
                         "bench_results_quick.json and a full one with bench_results.json")


def comparison(base: dict, new: dict, parts: set[str] | None = None, **tolerances: float
               ) -> tuple[list[str], int]:
    """The comparison's lines and the exit status (1: a headline regressed)."""
    verdicts = compare(base, new, parts, **tolerances)
    lost = [v.figure for v in verdicts if v.regressed]
    lines = table(verdicts)
    lines.append("")
    lines.append(f"regressed: {', '.join(lost)}" if lost else "no headline regressed")
    return lines, 1 if lost else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="relative change of a ratio's median below which it is the same")
    ap.add_argument("--delta-tolerance", type=float, default=DELTA_TOLERANCE,
                    help="the same for the reward deltas, in reward units")
    ap.add_argument("--share-tolerance", type=float, default=SHARE_TOLERANCE,
                    help="the same for the *_share* figures, in step units")
    args = ap.parse_args(argv)
    try:
        base, new = load_results(args.baseline), load_results(args.new)
        check_comparable(base, new, args.baseline, args.new)
    except ValueError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    lines, status = comparison(base, new, tolerance=args.tolerance,
                               delta_tolerance=args.delta_tolerance,
                               share_tolerance=args.share_tolerance)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
