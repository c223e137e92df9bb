"""The trainer: a torchrun program (entry: python -m relax_slurm.trainer). Nothing imports it."""
