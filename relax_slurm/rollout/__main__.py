"""`python -m relax_slurm.rollout --run-dir DIR`: the rollout worker (see rollout/worker.py).

The launcher starts the worker through this tiny module rather than `-m
relax_slurm.rollout.worker` because of the reward pool: every process multiprocessing starts
re-imports the parent's `__main__` module unless its name ends in `.__main__`, and the worker
module imports torch, transformers and datasets, which would cost each reward worker (and each
replacement of a killed one) seconds and hundreds of MB.
"""

from relax_slurm.rollout.worker import main

main()
