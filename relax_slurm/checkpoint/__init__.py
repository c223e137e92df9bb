"""Checkpoints: DCP save/load with atomic commit, resume rules, format conversion, HF export.

    handle = save_checkpoint(checkpoints_dir(run_dir), step, model, opt, sched, extra, keep_last)
    extra = load_checkpoint(path, model, opt, sched)
    path = resolve_resume(run_dir, cfg.resume, cfg.overwrite)   # Path | None
    save_hf(model, cfg.model.path, run_dir / "hf" / f"step_{step}")

torch is imported lazily: `resolve_resume` and `find_latest` stay cheap for the launcher.
"""

from relax_slurm.checkpoint.resume import (
    CheckpointError, checkpoints_dir, clear_checkpoints, find_latest, is_complete,
    list_checkpoints, resolve_resume, resume_for_attempt,
)

_LAZY = {
    "save_checkpoint": "dcp", "load_checkpoint": "dcp", "wait_pending": "dcp",
    "read_meta": "dcp", "SaveHandle": "dcp",
    "save_hf": "export", "convert_checkpoint": "convert", "detect_format": "formats",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"relax_slurm.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'relax_slurm.checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "SaveHandle", "checkpoints_dir", "clear_checkpoints", "convert_checkpoint",
    "detect_format", "find_latest", "is_complete", "list_checkpoints", "load_checkpoint",
    "read_meta", "resolve_resume", "resume_for_attempt", "save_checkpoint", "save_hf",
    "wait_pending",
]
