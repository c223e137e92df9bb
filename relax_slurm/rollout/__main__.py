"""`python -m relax_slurm.rollout --run-dir DIR`: the rollout worker (see rollout/worker.py).

The launcher starts the worker through this tiny module rather than `-m
relax_slurm.rollout.worker` because of the reward pool: every process multiprocessing starts
re-imports the parent's `__main__` module unless its name ends in `.__main__`: each reward
worker (and each replacement of a killed one) would import the whole worker and its
dependencies again (it once pulled in torch, transformers and datasets: seconds and hundreds of
MB each); this module imports only what it runs.
"""

from relax_slurm.rollout.worker import main

main()
