"""`model`: the Hugging Face model trainer and engines load."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class ModelConfig:
    path: str = MISSING
    """A Hugging Face model directory (config.json, weights, tokenizer), read with
    from_pretrained."""
    dtype: str = "float32"
    """Parameter dtype for trainer and engines: float32, bfloat16 or float16."""
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        check(self.dtype in ("float32", "bfloat16", "float16"),
               f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")
