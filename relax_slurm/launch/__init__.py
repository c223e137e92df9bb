"""Launchers: relax-train locally and on Slurm, relax_slurm.submit, relax-ctl, and the
supervisor they share. Its files import one way, in three layers (entry points, supervision,
helpers): docs/architecture.md, "The launcher in layers"."""
