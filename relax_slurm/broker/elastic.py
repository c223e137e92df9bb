"""Elastic rollout: the broker's engine list and its scale operations, as a pure state machine.

No sockets, no clocks (callers pass `now`), no processes: the broker holds one `Elastic` and
every role acts on what it reads from it (see docs/operations.md, "Elastic rollout"):

- the launcher (it owns processes) picks up a PENDING scale-out, starts engine processes (local)
  or takes the given URLs (external), and reports CREATING -> HEALTH_CHECKING -> WEIGHT_SYNCING;
- trainer rank 0 sees engines to join (their op is WEIGHT_SYNCING) or to leave (DETACHING),
  re-forms its weight-sync cohort with the engine set `cohort_urls()`, sends the current
  weights and reports `synced(urls)`: joining engines become active (op ACTIVE), leaving ones
  detached;
- the rollout worker routes only to `routable_urls()` (active engines) and reports an engine
  `drained` once none of its requests is in flight there;
- the launcher stops detached engines it started and reports `stopped`: they leave the list;
- the launcher reports an engine `lost` when it went away without a scale-in (its Slurm job
  ended, an external server stopped answering): it is detached at once, no drain and no
  weights; the trainer's cohort and the worker's routing leave it at their next look.

A scale-out: PENDING -> CREATING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE, or FAILED
(its timeout passed, or the launcher reported an error) / CANCELLED (`cancel`): both roll back,
its engines detach and are stopped. A scale-in: DRAINING -> DETACHING -> COMPLETED (drain ends
when the worker reported every engine drained, at `drain_timeout_s`, or at once with force).
One operation at a time; a target already met is a no-op. Engines from the initial launch are
protected from scale-in. Every change of the engine list bumps `membership`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from relax_slurm.errors import BrokerError

PENDING, CREATING, HEALTH_CHECKING, WEIGHT_SYNCING, ACTIVE = (
    "PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE")
FAILED, CANCELLED = "FAILED", "CANCELLED"
DRAINING, DETACHING, COMPLETED = "DRAINING", "DETACHING", "COMPLETED"
TERMINAL = frozenset({ACTIVE, FAILED, CANCELLED, COMPLETED})
# what the launcher may report for a scale-out, from which status
LAUNCHER_STEPS = {PENDING: CREATING, CREATING: HEALTH_CHECKING, HEALTH_CHECKING: WEIGHT_SYNCING}

# engine states
E_JOINING, E_ACTIVE, E_DRAINING, E_DETACHING, E_DETACHED = (
    "joining", "active", "draining", "detaching", "detached")
IN_COHORT = (E_ACTIVE, E_DRAINING, E_DETACHING)  # the trainer sends weights to these
SERVING = (E_JOINING, E_ACTIVE)  # counted against a num_replicas target


class OpRefused(BrokerError):
    """A request the admin API refuses; `code` is its HTTP status (400, 404, 409)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(kw_only=True)
class Engine:
    url: str
    name: str
    origin: str
    """initial (from the launch: protected), local (started by a scale-out) or external."""
    state: str = E_ACTIVE
    op: str | None = None
    """The operation that added or removes it."""
    lost: str | None = None
    """Why it went away without a scale-in (`Elastic.lost`), or None."""


@dataclass(kw_only=True)
class Op:
    request_id: str
    kind: str
    """scale_out or scale_in."""
    status: str
    mode: str
    """local (the launcher starts `add` engines), external (`engine_urls`), or drain."""
    add: int = 0
    urls: list[str] = field(default_factory=list)
    force: bool = False
    created: float = 0.0
    deadline: float = 0.0
    error: str | None = None
    history: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        return asdict(self)


def _urls(value: Any) -> list[str]:
    ok = isinstance(value, list) and value and all(
        isinstance(u, str) and u.startswith(("http://", "https://")) for u in value)
    if not ok:
        raise OpRefused(400, f"engine_urls must be a non-empty list of http(s) URLs, got {value!r}")
    return [u.rstrip("/") for u in value]


def _replicas(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OpRefused(400, f"num_replicas must be an integer >= 1, got {value!r}")
    return value


def _positive(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise OpRefused(400, f"{name} must be a number > 0, got {value!r}")
    return float(value)


def _one_of(body: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    has_n, has_urls = "num_replicas" in body, "engine_urls" in body
    if has_n == has_urls:
        raise OpRefused(400, "send exactly one of num_replicas (absolute target) or engine_urls")
    if has_n:
        return _replicas(body["num_replicas"]), None
    return None, _urls(body["engine_urls"])


class Elastic:
    def __init__(self, initial_urls: list[str], *, default_timeout_s: float = 600.0,
                 drain_timeout_s: float = 60.0, max_engines: int = 64) -> None:
        self.engines: dict[str, Engine] = {
            u.rstrip("/"): Engine(url=u.rstrip("/"), name=f"engine{i}", origin="initial")
            for i, u in enumerate(initial_urls)}
        self.ops: dict[str, Op] = {}
        self.current: str | None = None
        self.membership = 0
        self.default_timeout_s = default_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.max_engines = max_engines
        self._next_name = len(initial_urls)

    # ---- persistence (a broker restarted in place continues; see broker/__main__.py) -------
    def to_dict(self) -> dict[str, Any]:
        return {"engines": [asdict(e) for e in self.engines.values()],
                "ops": [asdict(o) for o in self.ops.values()], "current": self.current,
                "membership": self.membership, "next_name": self._next_name}

    def load(self, saved: dict[str, Any]) -> None:
        try:
            self.engines = {e["url"]: Engine(**e) for e in saved["engines"]}
            self.ops = {o["request_id"]: Op(**o) for o in saved["ops"]}
            self.current = saved["current"]
            self.membership = int(saved["membership"])
            self._next_name = int(saved["next_name"])
        except (KeyError, TypeError, ValueError) as e:
            raise BrokerError(f"elastic state file is not one this version wrote ({e!r}); "
                              "delete it to start from the launch's engines") from e

    # ---- reads ---------------------------------------------------------------------------
    def serving(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.state in SERVING]

    def routable_urls(self) -> list[str]:
        return [e.url for e in self.engines.values() if e.state == E_ACTIVE]

    def cohort_urls(self) -> list[str]:
        """The engine set the trainer's cohort should have now: every engine in it, plus those
        joining whose operation is at WEIGHT_SYNCING, minus those detaching."""
        out = []
        for e in self.engines.values():
            if e.state in (E_ACTIVE, E_DRAINING):
                out.append(e.url)
            elif e.state == E_JOINING and self.ops[e.op].status == WEIGHT_SYNCING:
                out.append(e.url)
        return out

    def view(self) -> dict[str, Any]:
        return {"membership": self.membership, "current_op": self.current,
                "engines": [asdict(e) for e in self.engines.values()],
                "routable": self.routable_urls(), "cohort": self.cohort_urls(),
                "op": self.ops[self.current].view() if self.current else None}

    def op(self, request_id: str) -> Op:
        if request_id not in self.ops:
            raise OpRefused(404, f"no operation {request_id!r}; GET /rollout/engines lists the "
                                 "current one")
        return self.ops[request_id]

    # ---- requests (admin API) ------------------------------------------------------------
    def _busy(self) -> None:
        if self.current is not None:
            op = self.ops[self.current]
            raise OpRefused(409, f"operation {op.request_id} ({op.kind}) is {op.status}; one at "
                                 f"a time: wait for it or POST /rollout/scale_out/"
                                 f"{op.request_id}/cancel")

    def _new_op(self, now: float, **kw: Any) -> Op:
        rid = f"{kw['kind'].replace('scale_', '')}-{len(self.ops) + 1}"
        op = Op(request_id=rid, created=now, **kw)
        op.history.append(op.status)
        self.ops[rid] = op
        return op

    def scale_out(self, body: dict[str, Any], now: float) -> dict[str, Any]:
        n, urls = _one_of(body)
        timeout_s = _positive(body, "timeout_secs", self.default_timeout_s)
        self._busy()
        if n is not None:
            have = len(self.serving())
            if n > self.max_engines:
                raise OpRefused(400, f"num_replicas={n} is above cluster.elastic.max_engines="
                                     f"{self.max_engines}; raise it at launch if the nodes "
                                     "hold more")
            if n <= have:
                return {"request_id": None, "status": ACTIVE, "noop": True,
                        "message": f"{have} engines serve already (target {n})"}
            op = self._new_op(now, kind="scale_out", status=PENDING, mode="local", add=n - have,
                              deadline=now + timeout_s)
        else:
            new = [u for u in urls if u not in self.engines]
            if not new:
                return {"request_id": None, "status": ACTIVE, "noop": True,
                        "message": "every engine_url is registered already"}
            op = self._new_op(now, kind="scale_out", status=PENDING, mode="external",
                              urls=new, deadline=now + timeout_s)
        self.current = op.request_id
        return {"request_id": op.request_id, "status": op.status}

    def scale_in(self, body: dict[str, Any], now: float) -> dict[str, Any]:
        n, urls = _one_of(body)
        force = body.get("force", False)
        dry_run = body.get("dry_run", False)
        if not isinstance(force, bool) or not isinstance(dry_run, bool):
            raise OpRefused(400, "force and dry_run must be booleans")
        if not dry_run:
            self._busy()
        serving = self.serving()
        if n is not None:
            if n >= len(serving):
                return {"request_id": None, "status": COMPLETED, "noop": True, "remove": [],
                        "message": f"{len(serving)} engines serve (target {n})"}
            removable = [e for e in serving if e.origin != "initial"]
            need = len(serving) - n
            if len(removable) < need:
                raise OpRefused(409, f"scale_in to {n} would remove {need} engines but only "
                                     f"{len(removable)} were added after the launch (engines "
                                     "of the initial launch are protected)")
            remove = [e.url for e in removable[-need:]]  # newest first out
        else:
            unknown = [u for u in urls if u not in self.engines]
            if unknown:
                raise OpRefused(404, f"engine_urls {unknown} are not engines of this run; GET "
                                     "/rollout/engines lists them")
            protected = [u for u in urls if self.engines[u].origin == "initial"]
            if protected:
                raise OpRefused(409, f"engines {protected} are from the initial launch and "
                                     "protected from scale_in")
            remove = [u for u in urls if self.engines[u].state in SERVING]
            if not remove:
                return {"request_id": None, "status": COMPLETED, "noop": True, "remove": [],
                        "message": "those engines are leaving or gone already"}
        if dry_run:
            return {"request_id": None, "status": "DRY_RUN", "remove": remove}
        joining = [u for u in remove if self.engines[u].state != E_ACTIVE]
        if joining:
            raise OpRefused(409, f"engines {joining} are still joining; cancel their scale_out")
        op = self._new_op(now, kind="scale_in", status=DRAINING, mode="drain", urls=remove,
                          force=force, deadline=now + self.drain_timeout_s)
        self.current = op.request_id
        for u in remove:
            self.engines[u].state, self.engines[u].op = E_DRAINING, op.request_id
        self.membership += 1
        if force:
            self._detach(op, "force: no drain")
        return {"request_id": op.request_id, "status": op.status, "remove": remove}

    def cancel(self, request_id: str) -> dict[str, Any]:
        op = self.op(request_id)
        if op.status in TERMINAL:
            return {"request_id": op.request_id, "status": op.status, "noop": True}
        if op.kind != "scale_out":
            raise OpRefused(409, f"{request_id} is a scale_in ({op.status}); it cannot be "
                                 "cancelled, scale out again afterwards")
        self._roll_back(op, CANCELLED, "cancelled")
        return {"request_id": op.request_id, "status": op.status}

    # ---- reports (launcher, trainer, worker) ---------------------------------------------
    def launcher_step(self, request_id: str, status: str, urls: list[str] | None = None,
                      error: str | None = None) -> Op:
        """The launcher moves a scale-out on (`LAUNCHER_STEPS`), or fails it with `error`."""
        op = self.op(request_id)
        if op.status in TERMINAL:
            return op  # cancelled or timed out meanwhile: the launcher sees it and rolls back
        if error is not None:
            self._roll_back(op, FAILED, error)
            return op
        if op.kind != "scale_out" or LAUNCHER_STEPS.get(op.status) != status:
            raise OpRefused(409, f"{request_id} is {op.kind} {op.status}; cannot go to {status}")
        if status == CREATING:
            if op.mode == "local":
                urls = _urls(urls)
                if len(urls) != op.add or any(u in self.engines for u in urls):
                    raise OpRefused(400, f"CREATING needs {op.add} new engine URLs, got {urls}")
                op.urls = urls
            origin = "local" if op.mode == "local" else "external"
            for u in op.urls:
                self.engines[u] = Engine(url=u, name=f"engine{self._next_name}", origin=origin,
                                         state=E_JOINING, op=op.request_id)
                self._next_name += 1
            self.membership += 1
        op.status = status
        op.history.append(status)
        if status == WEIGHT_SYNCING:
            self.membership += 1  # the cohort set changed
        return op

    def synced(self, urls: list[str]) -> None:
        """Trainer rank 0 re-formed its cohort with exactly `urls` and sent them the current
        weights: engines joining among them become active, those detaching become detached."""
        got = {u.rstrip("/") for u in urls}
        changed = False
        for e in self.engines.values():
            if e.state == E_JOINING and e.url in got and self.ops[e.op].status == WEIGHT_SYNCING:
                e.state, changed = E_ACTIVE, True
            elif e.state == E_DETACHING and e.url not in got:
                e.state, changed = E_DETACHED, True
        if changed:
            self.membership += 1
        op = self.ops.get(self.current) if self.current else None
        if op is None:
            return
        mine = [self.engines[u] for u in op.urls if u in self.engines]
        if op.status == WEIGHT_SYNCING and all(e.state == E_ACTIVE for e in mine):
            self._finish(op, ACTIVE)

    def drained(self, url: str) -> None:
        """The rollout worker has no request in flight at `url` and routes none there."""
        e = self.engines.get(url.rstrip("/"))
        if e is None or e.state != E_DRAINING:
            return
        e.state = E_DETACHING
        self.membership += 1
        op = self.ops[e.op]
        if op.status == DRAINING and all(self.engines[u].state != E_DRAINING for u in op.urls):
            op.status = DETACHING
            op.history.append(DETACHING)

    def stopped(self, url: str) -> None:
        """The launcher stopped a detached engine (or forgot an external one): it leaves."""
        e = self.engines.get(url.rstrip("/"))
        if e is None or e.state != E_DETACHED:
            return
        del self.engines[e.url]
        self.membership += 1
        op = self.ops.get(e.op) if e.op else None
        if (op is not None and op.status == DETACHING
                and not any(u in self.engines for u in op.urls)):
            self._finish(op, COMPLETED)

    def lost(self, url: str, why: str) -> bool:
        """The launcher saw an engine go away without a scale-in (its Slurm job ended, an
        external server stopped answering): detached at once (there is nothing to drain or to
        send weights to). A scale-in draining it counts it drained. False when it is not an
        engine in service (unknown, joining: its scale-out fails through the launcher)."""
        e = self.engines.get(url.rstrip("/"))
        if e is None or e.state not in (E_ACTIVE, E_DRAINING):
            return False
        draining = e.state == E_DRAINING
        e.state, e.lost = E_DETACHED, why
        self.membership += 1
        op = self.ops.get(e.op) if draining and e.op else None
        if op is not None and op.status == DRAINING and all(
                self.engines[u].state != E_DRAINING for u in op.urls if u in self.engines):
            op.status = DETACHING
            op.history.append(DETACHING)
        return True

    def to_stop(self) -> list[Engine]:
        """Detached engines the launcher should stop now."""
        return [e for e in self.engines.values() if e.state == E_DETACHED]

    def expire(self, now: float) -> None:
        """Deadlines: a scale-out past its timeout fails and rolls back; a drain past
        `drain_timeout_s` detaches what is left (the worker's in-flight requests there are
        abandoned by the engine's stop; their groups come back through the worker's retries)."""
        if self.current is None:
            return
        op = self.ops[self.current]
        if now < op.deadline:
            return
        if op.kind == "scale_out" and op.status not in TERMINAL:
            self._roll_back(op, FAILED, f"timeout_secs passed at {op.status}")
        elif op.kind == "scale_in" and op.status == DRAINING:
            self._detach(op, "drain timeout")

    # ---- internals -----------------------------------------------------------------------
    def _detach(self, op: Op, why: str) -> None:
        for u in op.urls:
            if self.engines[u].state == E_DRAINING:
                self.engines[u].state = E_DETACHING
        op.status = DETACHING
        op.history.append(f"{DETACHING} ({why})")
        self.membership += 1

    def _roll_back(self, op: Op, status: str, why: str) -> None:
        # at WEIGHT_SYNCING the trainer may have put the engines in its cohort already: they
        # leave it first (detaching, see `synced`); before that they never got weights
        syncing = op.status == WEIGHT_SYNCING
        for u in op.urls:
            e = self.engines.get(u)
            if e is not None:
                e.state = E_DETACHING if syncing else E_DETACHED
        self.membership += 1
        op.error = why
        self._finish(op, status)

    def _finish(self, op: Op, status: str) -> None:
        op.status = status
        op.history.append(status)
        if self.current == op.request_id:
            self.current = None
