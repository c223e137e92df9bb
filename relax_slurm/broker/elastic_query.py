"""Listing scale operations with filters and cancelling every matching scale-out at once: the
two routes of Relax's rollout API beside the ones `broker/elastic.py` serves, with its request
and reply shapes (`GET /rollout/scale_out?status=&model_name=`, `GET /rollout/scale_in?...`,
`POST /rollout/scale_out_cancel {status_filter, model_name, dry_run}`).

Pure functions over an `Elastic` (no sockets, no clock). A run trains one policy, named
MODEL_NAME as Relax's default: a `model_name` filter naming another matches nothing, as in
Relax for a model it does not serve.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.broker.elastic import (
    ACTIVE, CANCELLED, COMPLETED, CREATING, DETACHING, DRAINING, FAILED, HEALTH_CHECKING,
    PENDING, TERMINAL, WEIGHT_SYNCING, Elastic, OpRefused,
)

MODEL_NAME = "default"
STATUSES = {
    "scale_out": (PENDING, CREATING, HEALTH_CHECKING, WEIGHT_SYNCING, ACTIVE, FAILED, CANCELLED),
    "scale_in": (DRAINING, DETACHING, COMPLETED),
}


def _filters(kind: str, query: dict[str, Any], status_key: str) -> tuple[str | None, str | None]:
    """(model_name, status) of a request; 400 for a status the kind never has."""
    model = query.get("model_name")
    status = query.get(status_key)
    if model is not None and not isinstance(model, str):
        raise OpRefused(400, f"model_name must be a string, got {model!r}")
    if status is not None:
        if not isinstance(status, str) or status.upper() not in STATUSES[kind]:
            raise OpRefused(400, f"{status_key}={status!r}: a {kind} is one of "
                                 f"{', '.join(STATUSES[kind])}")
        status = status.upper()
    return model, status


def matching(el: Elastic, kind: str, model: str | None, status: str | None) -> list[str]:
    """Request ids of `kind` operations with that status (any if None), oldest first."""
    if model is not None and model != MODEL_NAME:
        return []
    return [rid for rid, op in el.ops.items()
            if op.kind == kind and (status is None or op.status == status)]


def list_ops(el: Elastic, kind: str, query: dict[str, Any]) -> dict[str, Any]:
    """GET /rollout/scale_out (or scale_in) with optional `status` and `model_name`."""
    model, status = _filters(kind, query, "status")
    ids = matching(el, kind, model, status)
    return {"requests": [el.ops[rid].view() | {"model_name": MODEL_NAME} for rid in ids],
            "total_count": len(ids), "model_name": model, "status_filter": status}


def cancel_matching(el: Elastic, body: dict[str, Any]) -> dict[str, Any]:
    """POST /rollout/scale_out_cancel: cancel (roll back) every scale-out matching
    `status_filter` and `model_name`; ended ones are skipped with the reason. `dry_run` only
    says what would be cancelled."""
    model, status = _filters("scale_out", body, "status_filter")
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise OpRefused(400, f"dry_run must be true or false, got {dry_run!r}")
    ids = matching(el, "scale_out", model, status)
    succeeded, skipped = [], []
    for rid in ids:
        op = el.ops[rid]
        if op.status in TERMINAL:
            skipped.append({"request_id": rid, "status": op.status,
                            "reason": f"already {op.status}"})
            continue
        if not dry_run:
            el.cancel(rid)
        succeeded.append(rid)
    return {"succeeded": succeeded, "skipped": skipped, "total_count": len(ids),
            "dry_run": dry_run, "filters": {"model_name": model, "status_filter": status}}
