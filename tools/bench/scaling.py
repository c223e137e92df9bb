"""Part 6: a small model of step time for N trainer GPUs and M engines, from measured costs.

Assumptions (documented in docs/benchmarks.md, all of them simplifications):
- generation of one batch takes G seconds on one engine and divides evenly over M engines,
  except for a long tail: the batch ends with its slowest sample, `tail` times the mean
  (tail=1: every response equally long, as on our tiny task);
- a train step takes T seconds on one trainer GPU and divides over N with a data-parallel
  efficiency `dp_eff` per doubling;
- a weight sync takes S seconds whatever N and M (one broadcast tree);
- colocated (the same P GPUs alternate: generate, then train) adds R seconds per step to
  offload and reload the engines' memory; async runs engines and trainer on disjoint GPUs
  (N + M = P) and hides generation behind training up to max_staleness.
What the async run pays for the tail is `engine_tail`, the tail the engines themselves pay:
- an engine with continuous batching (SGLang) refills the slot of a finished row from the next
  admitted request, and with max_staleness >= 1 the broker admits the next batch's groups while
  this batch's long rows run, so generation costs the mean length: engine_tail = 1;
- the hf engine runs one `generate` per batch until its longest row ends (the finished rows
  are computed on as padding), so it pays the tail on every batch: engine_tail = tail.
Streaming training (trainer/stream.py) computes on the groups already in while the last ones
generate, and a weight sync in retract mode lets rows in flight continue on the new weights
rather than draining them; neither removes the tail from the engines' own time. None of this
is measured on GPUs here: the long-tail costs come from the CPU run of tools/bench/longtail.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class Costs:
    G: float
    """Seconds to generate one batch on one engine (no tail)."""
    T: float
    """Seconds of one train step on one GPU."""
    S: float
    """Seconds of one weight sync."""
    R: float = 0.0
    """Seconds per step to release and resume engine memory when colocated."""
    tail: float = 1.0
    """Slowest sample / mean sample generation time within a batch."""
    dp_eff: float = 0.95
    """Data-parallel efficiency per doubling of trainer GPUs."""
    engine_tail: float = 1.0
    """The tail the engines pay in async mode: 1 with continuous batching, `tail` without."""


def train_time(c: Costs, n: int) -> float:
    return c.T / n / (c.dp_eff ** math.log2(max(n, 1)))


def colocated_step(c: Costs, p: int) -> float:
    """All P GPUs generate (waiting for the tail), then all P train."""
    return c.G * c.tail / p + train_time(c, p) + c.S + c.R


def sync_step(c: Costs, n: int, m: int) -> float:
    """Disjoint pools, strictly on-policy: generate, then train, then sync."""
    return c.G * c.tail / m + train_time(c, n) + c.S


def async_step(c: Costs, n: int, m: int) -> float:
    """Disjoint pools, bounded staleness: the slower side sets the pace."""
    return max(c.G * c.engine_tail / m, train_time(c, n) + c.S)


def best_split(c: Costs, p: int) -> tuple[int, int, float]:
    """The N + M = P split with the shortest async step."""
    return min(((n, p - n, async_step(c, n, p - n)) for n in range(1, p)), key=lambda x: x[2])


def sketch(c: Costs, gpus: tuple[int, ...] = (8, 16, 64)) -> list[dict]:
    rows = []
    for p in gpus:
        n, m, a = best_split(c, p)
        rows.append({"gpus": p, "trainer_gpus": n, "engines": m, "async_step_s": a,
                     "colocated_step_s": colocated_step(c, p),
                     "async_over_colocated": colocated_step(c, p) / a,
                     "async_over_sync_same_split": sync_step(c, n, m) / a})
    return rows
