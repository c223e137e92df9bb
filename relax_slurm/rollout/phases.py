"""Where the rollout worker's groups are now: how many are generating, scoring their rewards,
waiting on the teacher, ... The worker's heartbeat carries the counts (`groups_by_phase`), and
a stalled run's note says them (launch/waiting.py): a run whose reward takes a second a
response shows its groups piling up in "scoring", not just "27 groups in flight"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = {
    "media": "preparing media",
    "generating": "generating",
    "episodes": "playing episodes",
    "turns": "episodes' model turns generating",  # counted per episode, not per group
    "scoring": "scoring rewards",
    "teacher": "waiting on the teacher",
    "sending": "sending to the broker",
}
"""Each phase's key (in the heartbeat) and its words (in the stall note)."""


class Phases:
    """`with phases("scoring"): ...` counts a group in that phase while the block runs."""

    def __init__(self) -> None:
        self._now: Counter[str] = Counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        assert phase in PHASES, phase
        self._now[phase] += 1
        try:
            yield
        finally:
            self._now[phase] -= 1

    def snapshot(self) -> dict[str, int]:
        """{phase: groups in it now}, phases with none left out."""
        return {p: n for p, n in self._now.items() if n}
