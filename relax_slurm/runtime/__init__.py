"""What every role needs at run time, and nothing else: the run plan (addresses, written by the
launcher), the control files (preemption requests), a fast exit, the frozen heap, how a
process dies with its launcher (lifetime.py) and the zygote that forks a local run's roles and
ranks (zygote.py). Imports no other relax_slurm package, so roles and launcher both depend on
it and never on each other."""
