"""Restarts in place: a role whose spec says how to start it again (`RoleSpec.restart_argv`) is
started again on its own ports when it dies, while the other roles go on.

That is the broker (it replays its spill file, broker/spill.py, and its clients resend what it
had not answered), the rollout worker and the engines (see docs/operations.md). A role that is
alive but silent (no heartbeat, no /health: launch/health.py) is killed and started again the
same way. Each restart is a line in RUN_DIR/restarts.jsonl (`role`,
`kind: in_place`, `restart`, `cause`) and `roles.json` is rewritten with the new pid; past
`cluster.restart.max_per_role` restarts of one role its next death fails the attempt as before
(then `cluster.restart.max_global` decides).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from relax_slurm.launch.processes import ProcessSet, Role
from relax_slurm.launch.records import record_restart, write_roles
from relax_slurm.launch.roles import RoleSpec, Wrap


class InPlace:
    def __init__(self, procs: ProcessSet, specs: list[RoleSpec],
                 wrap: Wrap, run_dir: Path, cap: int,
                 on_restart: Callable[[str], None] = lambda name: None) -> None:
        self.procs = procs
        self.on_restart = on_restart
        self.specs = {s.name: s for s in specs if s.restart_argv is not None}
        self.wrap = wrap
        self.run_dir = run_dir
        self.cap = cap
        self.restarted: dict[str, int] = {}  # also of roles stopped since (a scaled-in engine)

    def revive(self) -> None:
        """Restart every dead role that may be restarted and has restarts left (the others are
        left for `ProcessSet.check_alive` to report)."""
        for role in self.procs.roles:
            rc = role.proc.poll()
            if rc is not None and self._may_restart(role.name):
                self._restart(role, f"exited with code {rc}")

    def revivable(self) -> tuple[str, ...]:
        """Roles the next `revive` restarts if they are dead by then: the supervisor's
        `check_alive` skips them, since a role that dies between `revive` and `check_alive`
        (one poll apart) would otherwise fail the attempt instead of being restarted."""
        return tuple(r.name for r in self.procs.roles if self._may_restart(r.name))

    def restart_hung(self, name: str, why: str) -> bool:
        """A role alive but silent (launch/health.py names it: `name` is a role or one of its
        heartbeat names, rollout0 for rollout): kill it and start it again, like a dead one.
        False when it may not be restarted in place (the caller fails the attempt then)."""
        role = next((r for r in self.procs.roles if r.name == name), None) or next(
            (r for r in self.procs.roles if name.startswith(r.name)), None)
        if role is None or not self._may_restart(role.name):
            return False
        self._restart(role, f"hung: {why}")  # ProcessSet.restart SIGKILLs its session first
        return True

    def _may_restart(self, name: str) -> bool:
        role = next(r for r in self.procs.roles if r.name == name)
        return name in self.specs and role.restarts < self.cap

    def _restart(self, role: Role, cause: str) -> None:
        spec = self.specs[role.name]
        self.procs.restart(role, self.wrap(replace(spec, argv=spec.restart_argv)), cpus=spec.cpus)
        self.on_restart(role.name)
        self.restarted[role.name] = role.restarts
        record_restart(self.run_dir, {"role": role.name, "kind": "in_place",
                                      "restart": role.restarts, "cause": cause})
        write_roles(self.procs, self.run_dir)
        print(f"relax-train: {role.name} {cause}; restarted in place ({role.restarts} of "
              f"cluster.restart.max_per_role={self.cap})", file=sys.stderr, flush=True)

    def counts(self) -> dict[str, int]:
        return dict(self.restarted)
