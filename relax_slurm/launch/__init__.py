"""Launchers: the run plan, the local runner, the Hydra CLI."""
