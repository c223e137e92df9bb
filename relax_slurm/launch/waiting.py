"""What a run waits on, in words, from the broker's `GET /status` (issue #35: a stalled run
says why): the launcher prints it when no step came for a while, `relax-ctl status` adds it.

Trainer rank 0 heartbeats a `waiting` map (trainer/lead.py `RankZero.waits`): "batch" (the
version and groups it asked for), "weight_sync" (the version and the engines that have not
finished their receive), "engines" (a re-forming waits for engines to answer). The broker adds
its queue (groups queued, in flight) and the rollout worker's heartbeat (groups in flight and
in which phase: generating, scoring rewards, ... (rollout/phases.py); requests open per engine;
the reward pool's busy workers and seconds per response), and says when the reward is what
holds the batch back. A pure function of the status: tested without a run.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.rollout.phases import PHASES


def _age(info: dict[str, Any]) -> str:
    return f"{float(info.get('heartbeat_age_s', 0.0)):.0f}s ago"


def _batch(want: dict[str, Any], status: BrokerStatus) -> str:
    c = status.counters
    text = (f"a batch for version {want.get('version')} ({c.queue_depth} of "
            f"{want.get('groups', status.batch_size)} groups queued, {c.in_flight} in flight"
            f"{'' if status.admission_open else ', admission closed'})")
    workers = {r: i for r, i in status.roles.items() if r.startswith("rollout")}
    if not workers:
        return text + "; no rollout worker has heartbeat yet"
    return f"{text}; {'; '.join(_worker(role, info) for role, info in workers.items())}"


def _worker(role: str, info: dict[str, Any]) -> str:
    """A rollout worker's groups, where they are, its engines' open requests, its reward pool,
    and, when the groups wait on the reward with every reward worker busy or on the
    environment's threads with every one busy, what to change."""
    phases = {p: n for p, n in (info.get("groups_by_phase") or {}).items() if n}
    where = ", ".join(f"{n} {PHASES.get(p, p)}"
                      for p, n in sorted(phases.items(), key=lambda kv: -kv[1]))
    busy = {url: n for url, n in (info.get("requests_open") or {}).items() if n}
    engines = ("requests open per engine: " + ", ".join(f"{u} {n}" for u, n in sorted(
        busy.items()))) if busy else "no engine request open"
    text = (f"{role}: {info.get('groups_in_flight', '?')} groups in flight"
            f"{f' ({where})' if where else ''}, {engines}")
    threads = info.get("env_threads") or {}
    if threads.get("waiting", 0) > 0:  # every env.threads thread taken, calls queued
        text += (f", all {threads['threads']} env.threads busy and {threads['waiting']} "
                 "environment calls waiting for one: raise env.threads, or make the "
                 "environment's step a coroutine (async def)")
    elif phases.get("episodes") and not phases.get("turns"):  # no model turn: env calls
        text += ", no episode's model turn generating: the episodes wait on the environment"
    pool = info.get("reward_workers") or {}
    if pool.get("workers"):
        per = pool.get("s_per_response")
        text += (f", reward workers {pool.get('busy', 0)} of {pool['workers']} busy"
                 + (f" (~{per:.2g} s a response)" if per else ""))
        groups = sum(n for p, n in phases.items() if p != "turns")  # turns count episodes
        if pool.get("busy", 0) >= pool["workers"] and phases.get("scoring", 0) > groups / 2:
            text += (": the reward is what the batch waits on; raise reward.num_workers or "
                     "make the reward faster")
    return f"{text} (heartbeat {_age(info)})"


def explain(status: BrokerStatus | None) -> str:
    """One line: what the trainer waits on, and the state that explains it."""
    if status is None:
        return "the broker does not answer GET /status (see logs/broker.log)"
    trainer = status.roles.get("trainer")
    if trainer is None:
        return "the trainer has not heartbeat yet (starting: loading the model, the engines)"
    waits = trainer.get("waiting") or {}
    parts = []
    if "weight_sync" in waits:
        sync = waits["weight_sync"]
        pending = sync.get("engines") or []
        parts.append(f"a weight sync of version {sync.get('version')} (not finished: "
                     f"{', '.join(pending) if pending else 'none, finishing'})")
    if "engines" in waits:
        parts.append(str(waits["engines"]))
    if "batch" in waits:
        parts.append(_batch(waits["batch"], status))
    if not parts:  # it beats only while it waits: silent, it computes
        return (f"the trainer is in a step (training, exporting or checkpointing; its last "
                f"heartbeat {_age(trainer)}, at step {trainer.get('step', '?')})")
    return f"the trainer waits for {'; and '.join(parts)} (the trainer's heartbeat {_age(trainer)})"


class StallNotes:
    """When to say what the run waits on: once no step came for `after_s` (3 heartbeat
    intervals, or twice the last step's time if longer: a slow step is not a stall), then
    every `after_s` while none comes."""

    def __init__(self, heartbeat_interval_s: float) -> None:
        self.floor_s = 3.0 * heartbeat_interval_s
        self.after_s = self.floor_s
        self.next_at: float | None = None

    def stepped(self, row: dict[str, Any], now: float) -> None:
        step_s = row.get("perf/step_time_s")
        if isinstance(step_s, (int, float)):
            self.after_s = max(self.floor_s, 2.0 * step_s)
        self.next_at = now + self.after_s

    def due(self, now: float, last_step_t: float) -> bool:
        if self.next_at is None:
            self.next_at = last_step_t + self.after_s
        if now < self.next_at:
            return False
        self.next_at = now + self.after_s
        return True
