"""Where checkpoints live, which one is the latest complete one, and what `resume=` means.

Pure filesystem logic (no torch), so the launcher can call it without importing torch.

Layout of a run directory:

    RUN_DIR/checkpoints/
        step_<N>/          a complete checkpoint (DCP shards, `.metadata`, `meta.json`, rng/, hf/)
        step_<N>.tmp/      a checkpoint being written (or left behind by a crash): never read
        step_<N>.del/      a checkpoint being deleted: never read
        latest             text file "step_<N>", replaced atomically after the rename (for
                           people and tools; find_latest orders by meta.json's save time)

A directory named `step_<N>` exists only once the whole checkpoint is on disk: it is written as
`step_<N>.tmp/` and renamed at the end (a rename within one filesystem is atomic). So a crash at
any moment leaves either the previous checkpoints or the new one, never a half-written
`step_<N>/`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from relax_slurm.errors import ConfigError, RelaxError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"  # written by rank 0, last file inside the .tmp directory
DCP_METADATA = ".metadata"  # written by torch.distributed.checkpoint once every rank's shard is
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RelaxError):
    """A checkpoint is missing, incomplete, of the wrong format or does not match the model."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step(path: str | Path) -> int | None:
    """The N of a `step_<N>` directory name, None for anything else (`.tmp`, `.del`, ...)."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint: DCP metadata and our meta.json both present."""
    p = Path(path)
    return (p / DCP_METADATA).is_file() and (p / META).is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete `step_<N>` checkpoints under a checkpoints directory, oldest save first.

    Ordered by the save time in meta.json, then by step: after resuming from an older
    checkpoint, the new saves (lower steps) are newer than the abandoned later ones.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child)
        if step is None or not child.is_dir() or not is_complete(child):
            continue
        saved = _saved_time(child)
        if saved is not None:
            found.append((saved, step, child))
    return [p for _, _, p in sorted(found)]


def _saved_time(path: Path) -> float | None:
    """meta.json's save time (0 if absent), None if meta.json is unreadable."""
    try:
        meta = json.loads((path / META).read_text())
        return float(meta.get("saved_unix", 0.0)) if isinstance(meta, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def _checkpoints_root(path: Path) -> Path:
    """Accept a run directory or its checkpoints/ directory."""
    sub = path / CHECKPOINTS
    return sub if sub.is_dir() else path


def find_latest(run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: the most recently saved complete one, or None.

    `run_dir` may be a run directory or its `checkpoints/` directory. Incomplete directories
    (`.tmp`, `.del`, files missing) are skipped. This is the checkpoint the `latest` pointer
    names, except after a crash between a checkpoint's rename and the pointer update: then it
    is that newer, complete checkpoint.
    """
    found = list_checkpoints(_checkpoints_root(Path(run_dir)))
    return found[-1] if found else None


def resolve_resume(run_dir: str | Path, resume: str | None, overwrite: bool) -> Path | None:
    """What `resume=` and `overwrite=` mean for this run directory.

    - `auto` (default): the latest complete checkpoint in run_dir, or None for a fresh start.
    - `none`: start fresh; refused when run_dir already holds checkpoints unless `overwrite`.
    - a path: that checkpoint (a `step_<N>` directory), or the latest one of a run directory.

    Raises ConfigError naming the override that fixes the problem.
    """
    mode = "none" if resume is None else str(resume).strip()
    if mode.lower() == "auto":
        return find_latest(run_dir)
    if mode.lower() in ("none", "null", "false", "no"):
        latest = find_latest(run_dir)
        if latest is not None and not overwrite:
            raise ConfigError(
                f"resume=none but run_dir={run_dir} already holds checkpoints (latest: {latest}). "
                "Fix: resume=auto to continue that run, overwrite=true to start over in it "
                "(its checkpoints are replaced), or pick another run_dir"
            )
        return None
    if not mode:
        raise ConfigError("resume is empty: use auto, none, or the path of a checkpoint")
    return _resolve_path(Path(mode).expanduser())


def _last_logged_step(run_dir: Path) -> int | None:
    """The step of the last row of run_dir/metrics.jsonl, or None without one."""
    path = run_dir / "metrics.jsonl"
    last = None
    try:
        with path.open() as f:
            for line in f:
                try:
                    last = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line (the crash), or not a step row
    except OSError:
        return None
    return last


def find_resumable(run_dir: str | Path) -> Path | None:
    """The latest checkpoint of this run that its metrics log reaches (its step at most the
    last row's step + 1), else the latest one.

    The trainer saves step_N, then logs the row of step N-1: a trainer killed in between
    leaves a checkpoint one row ahead of metrics.jsonl. Resuming there would lose that row for
    good (and summary.json would count its samples as lost); the checkpoint before it re-runs
    the step and logs it (seen: a trainer frozen right after a save).
    """
    found = list_checkpoints(_checkpoints_root(Path(run_dir)))
    logged = _last_logged_step(Path(run_dir))
    if logged is not None:
        for ckpt in reversed(found):
            if parse_step(ckpt) <= logged + 1:
                return ckpt
    return found[-1] if found else None


def resume_for_attempt(run_dir: str | Path, resume: str | None, overwrite: bool,
                       attempt: int) -> Path | None:
    """What attempt `attempt` of a run resumes from. A restarted or requeued attempt
    (attempt > 0) continues its own run from its latest checkpoint that its metrics log
    reaches (`find_resumable`), whatever `resume=` and `overwrite=` say: they apply to the
    first attempt, where overwrite clears old checkpoints."""
    latest = find_resumable(run_dir) if attempt > 0 else None
    if latest is not None:
        return latest
    path = resolve_resume(run_dir, resume, overwrite)
    if path is None and overwrite:
        clear_checkpoints(run_dir)
    return path


def _resolve_path(path: Path) -> Path:
    if not path.exists():
        raise ConfigError(f"resume={path}: no such file or directory. Fix: resume=auto, "
                          "resume=none, or the path of a checkpoints/step_<N> directory")
    if path.is_dir() and is_complete(path):
        return path.resolve()
    if path.is_dir() and ((path / "config.json").is_file() and not (path / DCP_METADATA).exists()):
        raise ConfigError(
            f"resume={path} is a Hugging Face model directory, not a checkpoint. Fix: start from "
            f"it with model.path={path} resume=none, or convert it first: "
            f"relax-convert --input {path} --output OUT --to dcp"
        )
    if path.is_dir():
        latest = find_latest(path)
        if latest is not None:
            return latest.resolve()
    raise ConfigError(
        f"resume={path} is not a complete checkpoint (it needs {DCP_METADATA} and {META}; a "
        "step_<N>.tmp directory is a save that did not finish). Fix: point resume= at a "
        "checkpoints/step_<N> directory or a run_dir with checkpoints, or use resume=auto"
    )


def clear_checkpoints(run_dir: str | Path) -> None:
    """Delete run_dir/checkpoints (for resume=none overwrite=true), renaming it away first so a
    crash mid-delete never leaves a half-deleted checkpoint that looks complete."""
    root = checkpoints_dir(run_dir)
    if not root.exists():
        return
    doomed = root.with_name(f"{CHECKPOINTS}.del")
    if doomed.exists():
        shutil.rmtree(doomed)
    root.rename(doomed)
    shutil.rmtree(doomed)
