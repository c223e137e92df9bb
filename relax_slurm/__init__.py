"""relax-slurm: Slurm-native RL post-training for LLMs, without Ray.

    relax_slurm.submit(["experiment=tiny_cpu", "cluster.partition=gpu"])  # -> submitit Job

Exports are loaded on first use: every role process imports this package, and none of them
needs Hydra or submitit.
"""

__version__ = "0.1.0"

_LAZY = {"submit": "relax_slurm.launch.submit", "compose_config": "relax_slurm.launch.submit"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'relax_slurm' has no attribute {name!r}")
