"""What every role needs at run time, and nothing else: the run plan (addresses, written by the
launcher), the control files (preemption requests), a fast exit, the frozen heap. Imports no
other relax_slurm package, so roles and launcher both depend on it and never on each other."""
