"""`sft`: supervised fine-tuning's rows and validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning (`algo=sft`, trainer/sft.py): rows of data.train_files with their
    targets; the trainer alone runs, one optimizer step per `batch_size` rows."""

    response_key: str = "response"
    """Column holding the target answer (a string) to data.prompt_key's prompt."""
    messages_key: Optional[str] = None
    """Column of chat conversations ({role, content} lists); when set it replaces the prompt
    and response columns and every assistant turn is trained (verl's multiturn messages)."""
    batch_size: int = 32
    """Rows per optimizer step (all data-parallel ranks together); divides by their count."""
    max_tokens: int = 1024
    """Rows longer than this (prompt + response tokens) are dropped, with a count logged."""
    val_files: list[str] = field(default_factory=list)
    """Held-out rows (same columns) whose token-mean NLL is logged as val/loss; empty: none."""
    val_every: int = 0
    """Steps between validations (also after the last step when val_files are set); 0: at the
    end only."""

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, f"sft.batch_size={self.batch_size}: must be >= 1")
        check(self.max_tokens >= 2, f"sft.max_tokens={self.max_tokens}: must be >= 2")
        check(self.val_every >= 0, f"sft.val_every={self.val_every}: must be >= 0")
