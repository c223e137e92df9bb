"""The broker's side of elastic rollout (the engine list itself: broker/elastic.py): the
`engines` operation of trainer rank 0 and rollout workers, the admin HTTP's `/rollout/...`
routes, deadlines, and the JSON file a broker restarted in place continues from.

The broker holds its lock around every call: they change the same `Elastic` its loop reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_slurm.broker.elastic import Elastic, OpRefused
from relax_slurm.broker.elastic_query import cancel_matching, list_ops
from relax_slurm.errors import BrokerError

_OPS = ("scale_out", "scale_in")


class ElasticRoutes:
    def __init__(self, elastic: Elastic, file: Path | None,
                 log: Callable[[str], None]) -> None:
        self.elastic = elastic
        self._file = file  # its state, rewritten on every change
        self._saved = ""
        self.log = log

    def view(self) -> dict[str, Any]:
        return self.elastic.view()

    def engines_op(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Trainer rank 0 and rollout workers poll the engine list with their heartbeats and
        report what they did: `synced` (the trainer's cohort is exactly these URLs, holding the
        current weights), `drained` (a worker routes nothing to these URLs any more)."""
        el = self.elastic
        before = el.membership
        synced, drained = fields.get("synced"), fields.get("drained") or []
        for name, value in (("synced", synced if synced is not None else []),
                            ("drained", drained)):
            if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
                raise BrokerError(f"engines: {name} must be a list of URLs, got {value!r}")
        if synced is not None:
            el.synced(synced)
        for url in drained:
            el.drained(url)
        if el.membership != before:
            self.log(f"broker: engines membership {el.membership}: "
                     f"routable={el.routable_urls()} cohort={el.cohort_urls()}")
        self.save()
        return el.view()

    def save(self) -> None:
        """Write the engine list and operations when they changed (atomic replace): a broker
        restarted in place continues with them."""
        if self._file is None:
            return
        text = json.dumps(self.elastic.to_dict())
        if text == self._saved:
            return
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self._file)
        self._saved = text

    def expire(self, now: float) -> None:
        before = self.elastic.membership
        self.elastic.expire(now)
        if self.elastic.membership != before:
            self.log(f"broker: elastic deadline passed: {self.elastic.view()['op']}")
            self.save()

    def route(self, method: str, path: str, body: dict[str, Any], now: float
              ) -> tuple[int, dict[str, Any]]:
        """The admin HTTP's /rollout/... routes (see broker/admin.py): (status code, body)."""
        parts = [p for p in path.split("?")[0].split("/") if p]
        try:
            if method == "GET":
                return self._get(parts, body, path)
            out = self._post(parts, body, now) if method == "POST" else None
        except OpRefused as e:
            return e.code, {"error": str(e)}
        if out is None:
            return _no_route(method, path)
        self.save()
        self.log(f"broker: {method} {path} -> {out.get('status', '')} "
                 f"membership={self.elastic.membership}")
        created = parts[-1] in _OPS and out.get("request_id")
        return (202 if created else 200), out

    def _get(self, parts: list[str], body: dict[str, Any], path: str
             ) -> tuple[int, dict[str, Any]]:
        el = self.elastic
        if parts == ["rollout", "engines"]:
            return 200, el.view()
        if len(parts) == 2 and parts[1] in _OPS:
            return 200, list_ops(el, parts[1], body)  # body: the query's filters
        if len(parts) == 3 and parts[1] in (*_OPS, "ops"):
            return 200, el.op(parts[2]).view()
        return _no_route("GET", path)

    def _post(self, parts: list[str], body: dict[str, Any], now: float
              ) -> dict[str, Any] | None:
        """The changes: scale out / in, cancel, and the launcher's internal reports; None when
        no route matches."""
        el = self.elastic
        if parts == ["rollout", "scale_out"]:
            return el.scale_out(body, now)
        if parts == ["rollout", "scale_in"]:
            return el.scale_in(body, now)
        if parts == ["rollout", "scale_out_cancel"]:
            return cancel_matching(el, body)
        if len(parts) == 4 and parts[1] == "scale_out" and parts[3] == "cancel":
            return el.cancel(parts[2])
        if len(parts) == 4 and parts[1:4:2] == ["ops", "step"]:
            # the launcher moves a scale-out on (internal)
            return el.launcher_step(parts[2], body.get("status"), body.get("urls"),
                                    body.get("error")).view()
        if parts == ["rollout", "engines", "stopped"]:
            el.stopped(str(body.get("url", "")))  # the launcher stopped it (internal)
            return el.view()
        if parts == ["rollout", "engines", "lost"]:
            # the launcher saw it go away without a scale-in (internal)
            el.lost(str(body.get("url", "")), str(body.get("why", "lost")))
            return el.view()
        return None


def _no_route(method: str, path: str) -> tuple[int, dict[str, Any]]:
    return 404, {"error": f"no route {method} {path}; see docs/operations.md (Elastic rollout)"}
