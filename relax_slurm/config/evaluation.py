"""`eval`: periodic evaluation on the engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class EvalConfig:
    every: int = 0
    """Evaluate on the engines every this many steps (and after the last); 0 disables."""
    datasets: list[str] = field(default_factory=list)
    """jsonl / parquet files read like data.train_files (same keys); metrics are named after
    each file's stem: eval/<stem>/mean@k, eval/<stem>/pass@k."""
    n_samples: int = 1
    """k: responses per prompt. 1 with temperature 0 is greedy accuracy."""
    temperature: float = 0.0
    """0 is greedy; use > 0 with n_samples > 1 for pass@k."""
    max_prompts: int = 0
    """Evaluate the first this many prompts of each dataset; 0: all."""

    def __post_init__(self) -> None:
        check(self.every >= 0, f"eval.every={self.every}: must be >= 0")
        check(self.every == 0 or len(self.datasets) > 0,
               f"eval.every={self.every} but eval.datasets is empty: set "
               "eval.datasets=[path/to/test.jsonl] or eval.every=0")
        check(self.n_samples >= 1, f"eval.n_samples={self.n_samples}: must be >= 1")
        check(self.temperature > 0 or self.n_samples == 1,
               f"eval.n_samples={self.n_samples} with eval.temperature=0 draws the same greedy "
               "response k times: set eval.temperature (e.g. 0.6) or eval.n_samples=1")
