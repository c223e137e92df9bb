"""Rollout: the worker loop, its modes (single-turn, episodes, agent proxy), routing to the
engines. The engines and their clients are in `relax_slurm.engines`."""
