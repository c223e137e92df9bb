"""Imported by the reward pool's fork server: loads math-verify and SymPy once, so that every
reward worker forked from that server (including replacements of killed ones) starts warm."""

from relax_slurm.rewards.math import warm_up

warm_up()
