"""`broker`: the broker's address, message limit and spill file."""

from __future__ import annotations

from dataclasses import dataclass

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class BrokerConfig:
    request_timeout_s: float = 60.0
    """Timeout of one request/reply with the broker."""
    host: str = "127.0.0.1"
    """Interface the broker binds (local runs); on Slurm the node's address."""
    max_message_mb: int = 1024
    """Largest request the broker accepts, in MB; a peer sending more is disconnected."""
    spill: bool = True
    """Record the broker's state in RUN_DIR/broker/spill.bin so that it restarts in place (see
    operations.md); false: a dead broker is a global restart."""
    spill_fsync: bool = False
    """fsync every spill record (survives the machine going down, not just the broker)."""
    spill_compact_mb: int = 1024
    """Rewrite the spill file as a snapshot of the live state once it is larger than this."""

    def __post_init__(self) -> None:
        check(self.max_message_mb >= 1, f"broker.max_message_mb={self.max_message_mb}: >= 1")
        check(self.spill_compact_mb >= 1,
               f"broker.spill_compact_mb={self.spill_compact_mb}: >= 1")
