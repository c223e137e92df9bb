"""Notifications through Apprise (`notify.urls`): start, every N steps, completion, crash.

Apprise is optional: without it the run warns once at start and goes on. A notification that
fails to send is logged and never fails the run (a Slack outage must not stop training).
"""

from __future__ import annotations

import logging
from typing import Any

from relax_slurm.config.reporting import NotifyConfig

log = logging.getLogger("relax_slurm.notify")
MAX_BODY_CHARS = 3000  # chat services truncate or reject longer messages; keep the log tail's end
KEY_METRICS = ("rollout/reward_mean", "rollout/response_len_mean", "train/entropy",
               "broker/staleness_max", "perf/step_time_s")


class Notifier:
    def __init__(self, cfg: NotifyConfig, run_name: str) -> None:
        self.every = cfg.every_steps
        self.run_name = run_name
        self._apprise = None
        self._last: dict[str, Any] = {}
        if not cfg.urls:
            return
        try:
            import apprise
        except ImportError:
            log.warning("notify.urls is set but apprise is not installed: no notifications "
                        "(`pip install apprise` or `pip install relax-slurm[observability]`)")
            return
        self._apprise = apprise.Apprise()
        for url in cfg.urls:
            if not self._apprise.add(url):
                log.warning("notify.urls: apprise does not understand %r; skipped", url)

    @property
    def active(self) -> bool:
        return self._apprise is not None and len(self._apprise) > 0

    def send(self, event: str, body: str) -> None:
        if not self.active:
            return
        if len(body) > MAX_BODY_CHARS:
            body = "...\n" + body[-MAX_BODY_CHARS:]
        try:
            ok = self._apprise.notify(title=f"[relax] {self.run_name}: {event}", body=body)
        except Exception as e:  # noqa: BLE001 - any plugin failure: log, keep training
            log.warning("notification %r failed: %s", event, e)
            return
        if not ok:
            log.warning("notification %r was not delivered to every notify.urls target", event)

    def on_row(self, row: dict[str, Any], total_steps: int) -> None:
        """Every `every_steps` steps: the key metrics and their change since the last message."""
        done = int(row.get("step", 0)) + 1
        if not self.every or done % self.every:
            return
        self.send(f"step {done}/{total_steps}", step_message(row, self._last))
        self._last = row


def step_message(row: dict[str, Any], prev: dict[str, Any]) -> str:
    """Pure: 'key = value (+delta)' per key metric present in `row`."""
    lines = []
    for key in KEY_METRICS:
        v = row.get(key)
        if not isinstance(v, (int, float)):
            continue
        p = prev.get(key)
        delta = f" ({v - p:+.4g})" if isinstance(p, (int, float)) else ""
        lines.append(f"{key} = {v:.4g}{delta}")
    return "\n".join(lines)
