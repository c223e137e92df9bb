"""Hang detection for the launcher: a role that is alive but makes no progress.

The trainer and the rollout worker heartbeat to the broker from their main loops (every
`cluster.restart.heartbeat_interval_s`), so a heartbeat means "my loop turned", not just "my process
exists". Every interval the launcher reads the broker's admin `GET /status` and probes each
engine's `/server_info`; `check()` names the first of them silent for longer than
`cluster.restart.heartbeat_timeout_s`:

- a role whose last heartbeat is older than that (a role that never heartbeat yet is still
  starting: `cluster.restart.step_timeout_s` covers a run that never gets going);
- the broker, when /status has not answered for that long;
- an engine, when /server_info has not answered 200 for that long (SGLang serves it too, so
  engines need no heartbeat code of their own). Not /health: SGLang's generates a token, which
  waits while the trainer has generation paused (a sync, a train step with released memory)
  and answers 503 after 20 s, so a long pause would read as a hang. /server_info asks the
  scheduler for its state, which it answers paused or not (EngineClient.alive).

The supervisor restarts the role it names in place when it may (broker, rollout worker,
engines: launch/restart.py), like a dead one; otherwise (the trainer, or restarts used up) it
raises `RoleHung`, which ends the attempt like a dead role (and is followed by a global restart
when `cluster.restart.max_global` allows).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.engines.client import probe_alive

PROBE_TIMEOUT_S = 5.0


class HangWatch:
    def __init__(self, admin_url: str | None, secret: str, engines: dict[str, str],
                 interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 engine_key: str | None = None, startup_s: float = 0.0) -> None:
        """`engines`: role name -> base URL; `engine_key`: their API key (the run's secret
        unless the user set RELAX_ENGINE_API_KEY); `startup_s`: how long a role restarted in
        place may take to start (rollout.startup_timeout_s: an engine loads its model again,
        minutes for a large one) before its silence counts, if longer than the timeout."""
        self.admin_url = admin_url
        self.engines = dict(engines)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.grace_s = max(timeout_s, startup_s)
        self._clock = clock
        now = clock()
        self._next = now + interval_s
        # a probe that fails counts from the watch's start (the roles are starting then)
        self._last_ok = {"broker": now, **{name: now for name in engines}}
        self._restarted: dict[str, float] = {}  # role -> when it was restarted in place
        timeout = min(PROBE_TIMEOUT_S, interval_s)
        self._admin = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {secret}"})
        self._probe = httpx.Client(timeout=timeout, headers={
            "Authorization": f"Bearer {engine_key or secret}"})

    def close(self) -> None:
        self._admin.close()
        self._probe.close()

    def restarted(self, name: str) -> None:
        """`name` was just restarted in place: it is starting, as at the run's start, for up
        to max(timeout, startup_s); its silence counts from then (an engine loading its model
        again is not hung; the broker keeps its predecessor's heartbeat age until the new
        process heartbeats). A 15 s timeout named a restarted engine hung again while it still
        imported torch on a loaded machine, and a 600 s one a 30B engine loading for 1200."""
        now = self._clock()
        self._restarted[name] = now
        if name in self._last_ok:
            self._last_ok[name] = now + self.grace_s - self.timeout_s
        if name in self.engines:  # whoever waited on it (a push, a request) gets its time too
            self._restarted[""] = now

    def _in_grace(self, heartbeat_name: str, now: float) -> bool:
        """Restarted in place (or, "" for every role, an engine was) within the grace."""
        return any(heartbeat_name.startswith(name) and now - t <= self.grace_s
                   for name, t in self._restarted.items())

    def check(self) -> tuple[str, str] | None:
        """(role, why) for the first hung role, probing at most once per interval; else None."""
        if self.timeout_s <= 0:
            return None
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        # engines first: a trainer or worker blocked on a hung engine (a weight push, a
        # request) falls silent too, but the engine is the one to restart
        hung, silent = None, False
        for name, url in self.engines.items():
            if probe_alive(self._probe, url):
                self._last_ok[name] = self._clock()
                continue
            silent = True
            if hung is None and self._clock() - self._last_ok[name] > self.timeout_s:
                hung = (name, f"has not answered /server_info for {self.timeout_s:.0f}s "
                              "(cluster.restart.heartbeat_timeout_s)")
        # ... and its last beat can predate the engine's last answer (it went into a push
        # just before the engine froze): while an engine does not answer, no role is named
        # for silence; the engine is, once silent for the timeout, and its restart gives
        # the roles the timeout anew (`restarted`)
        return hung or self._check_broker(now, roles=not silent)

    def _check_broker(self, now: float, roles: bool = True) -> tuple[str, str] | None:
        if self.admin_url is None:
            return None
        status = self.broker_status()
        if status is None:
            if now - self._last_ok["broker"] > self.timeout_s:
                return ("broker", f"has not answered GET /status for {self.timeout_s:.0f}s "
                                  "(cluster.restart.heartbeat_timeout_s)")
            return None
        self._last_ok["broker"] = now
        if not roles:
            return None
        for role, age in status.heartbeat_ages().items():
            if age > self.timeout_s and not self._in_grace(role, now):
                return (role, f"sent no heartbeat for {age:.0f}s > "
                              f"cluster.restart.heartbeat_timeout_s={self.timeout_s:.0f}s "
                              "(hung: alive, but its main loop makes no "
                              "progress)")
        return None

    def broker_status(self) -> BrokerStatus | None:
        """The broker's /status now, or None (no answer); BrokerError if it answers something
        else than a BrokerStatus (broker/stats.py), naming the key."""
        if self.admin_url is None:
            return None
        try:
            r = self._admin.get(self.admin_url + "/status")
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return None if body is None else BrokerStatus.from_dict(body)

