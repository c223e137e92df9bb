"""The built-in rewards, registered by importing their modules (each `@register`s itself).

Imported by the package and by a reward-pool worker, which must register them before it
scores a reward by name (a worker is a fresh process)."""

from relax_slurm.rewards import (  # noqa: F401
    dapo, dapo_genrm, deepscaler, exact_match, f1, genrm, geo3k, ifbench, ifeval, math,
    multiple_choice, openr1mm, prefix_match, remote,
)
