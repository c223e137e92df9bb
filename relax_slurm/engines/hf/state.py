"""The hf engine's state in one object: the queue, the batch in flight, and the flags that decide
what it does next (paused and how, a weight-update session, weights left partial by a failed
update, memory released). No threads and no model here: `HFEngine` (core.py) changes it
under its condition, and the server reads it only through `HFEngine.status()` and the
engine's public methods.

Invariants: `interrupt` is set while paused (the pause's mode) or for the batch an abort_all
stops; `running` is non-empty only while `busy`; a row `held_in_place` waits in `pending`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from relax_slurm.engines.hf.batch import Row
from relax_slurm.engines.hf.parsing import BadRequest, NotServing

PARTIAL_WEIGHTS = ("the last weight update failed midway and left a mix of two versions: "
                   "generation resumes after the next complete /update_weights_from_distributed")


@dataclass
class EngineState:
    pending: deque[Row] = field(default_factory=deque)
    """Rows waiting for a batch, head first (retracted rows go back to the head)."""
    running: list[Row] = field(default_factory=list)
    """The rows of the generate call in flight."""
    busy: bool = False
    """A batch was taken from the queue and is not delivered yet."""
    paused: bool = False
    interrupt: Optional[str] = None
    """A pause's mode (or an abort_all's "abort") the batch in flight obeys: it stops after
    its current token, and its unfinished rows are aborted or go back to the queue."""
    session: bool = False
    """A weight-update session is open (/begin_weight_update)."""
    partial_weights: bool = False
    """The last update failed midway: nothing is served until a complete one."""
    released: set[str] = field(default_factory=set)
    """Memory regions let go by /release_memory_occupation (colocated placement); CPU
    frees nothing, but generation is refused until resumed, as SGLang cannot generate
    without its weights and KV cache."""

    def check_serving(self) -> None:
        """Refuse a /generate the engine cannot serve now (BadRequest, or NotServing: 503)."""
        if self.released:
            raise BadRequest(f"memory {sorted(self.released)} is released: call "
                             "/resume_memory_occupation before /generate")
        if self.partial_weights:
            raise NotServing(PARTIAL_WEIGHTS)

    def held_in_place(self) -> bool:
        """Requests paused in place (SGLang: still in the running batch)."""
        return any(r.held_in_place for r in self.pending)

    def idle_or_paused(self) -> bool:
        """What SGLang asserts before releasing memory: nothing running (a paused engine's
        queue does not count, its in-place batch does)."""
        if self.paused:
            return not self.held_in_place()
        return not self.busy and not self.pending

    def status(self) -> dict[str, Any]:
        return {"paused": self.paused, "pause_mode": self.interrupt if self.paused else None,
                "queued_sequences": len(self.pending),
                "running_sequences": len(self.running),
                "running_tokens": sum(len(r.out_ids) for r in self.running),
                "held_in_place": sum(r.held_in_place for r in self.pending),
                "weight_update_session": self.session,
                "partial_weights": self.partial_weights,
                "memory_released": sorted(self.released)}
