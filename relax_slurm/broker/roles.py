"""Who the broker's clients are: the roles that heartbeat (when last, with what info) and the
routing ids behind each holder name.

A client's ZMQ routing id is `<name>:<random>`: the name ("rollout0") is the same for every
process of one role, so credits are held per name (`holder_of`). A worker restarted in place
keeps its name and gets a new routing id; at its `rejoin` the ids of its predecessors are
retired, so a group the dead process had sent before cannot spend its successor's credit.
Pure: no sockets, bounded in what a buggy client can add.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.errors import BrokerError

MAX_ROLES = 4096  # distinct heartbeat names kept
MAX_INFO_ENTRIES = 32
MAX_ROLE_CHARS = 128


def holder_of(identity: bytes) -> str:
    """The name part of a client's routing id ("rollout0" of "rollout0:9f3a...")."""
    return identity.split(b":", 1)[0].decode("utf-8", "replace")


class Roles:
    def __init__(self) -> None:
        self._beats: dict[str, tuple[float, dict[str, Any]]] = {}  # role -> (time, info)
        self._ids_of: dict[str, set[bytes]] = {}  # holder -> routing ids seen
        self._retired: set[bytes] = set()  # routing ids a rejoin replaced

    def seen(self, identity: bytes) -> str:
        """Note a routing id under its holder name; the holder."""
        holder = holder_of(identity)
        self._ids_of.setdefault(holder, set()).add(identity)
        return holder

    def rejoin(self, identity: bytes) -> str:
        """`identity` is now its holder's only process: every other id of it is retired."""
        holder = holder_of(identity)
        self._retired |= self._ids_of.pop(holder, set()) - {identity}
        self._ids_of[holder] = {identity}
        return holder

    def retired(self, identity: bytes) -> bool:
        return identity in self._retired

    def beat(self, role: Any, info: Any, now: float) -> None:
        """Record a heartbeat; BrokerError for a malformed one (nothing recorded)."""
        if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
            raise BrokerError(f"heartbeat needs a non-empty role string, got {role!r}")
        info = info or {}
        if not isinstance(info, dict) or len(info) > MAX_INFO_ENTRIES:
            raise BrokerError(f"heartbeat info must be a map of at most {MAX_INFO_ENTRIES} "
                              "entries")
        if role not in self._beats and len(self._beats) >= MAX_ROLES:
            raise BrokerError(f"more than {MAX_ROLES} roles heartbeat; refusing {role!r}")
        self._beats[role] = (now, info)

    def ages(self, now: float) -> dict[str, float]:
        """Seconds since each role's last heartbeat."""
        return {role: now - t for role, (t, _) in self._beats.items()}

    def view(self, now: float) -> dict[str, dict[str, Any]]:
        """Per role (sorted): its heartbeat's age and the info it sent (admin GET /status)."""
        return {role: {"heartbeat_age_s": now - t, **info}
                for role, (t, info) in sorted(self._beats.items())}
