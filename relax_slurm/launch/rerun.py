"""Starting `relax-train` again in a run directory that already ran: say what happens (resume
from step N, or nothing to do) and never let a resume silently change what the steps ran with.

A resume trains the remaining steps with the new command line's config, but config.yaml and
summary.json describe the whole run. So a resume whose config differs from the one its
checkpoint's steps ran with is refused, naming every key that differs, unless the user says
`resume_with_changes=true`; every start that changes the config is recorded in
`RUN_DIR/config_history.jsonl` (`from_step` and the changed keys, old and new), so each step
range's values stay known. Keys that do not change what a step computes (where and how the run
is launched, timeouts, checkpoint cadence, logging) and the run's length may change freely.

The comparison and the rule are pure functions of two plain dicts; the launcher reads the
files (`plan_rerun`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from relax_slurm.checkpoint.resume import parse_step, resolve_resume
from relax_slurm.config import TrainConfig
from relax_slurm.config.algo import SUPERVISED_ALGOS
from relax_slurm.config.moved import move_old_keys
from relax_slurm.errors import ConfigError

HISTORY_FILE = "config_history.jsonl"
CONFIG_FILE = "config.yaml"
LAUNCH_ONLY = ("run_dir", "resume", "overwrite", "resume_with_changes")
"""How this start was asked for: never a change of what steps ran with (not even recorded)."""
FREE_ON_RESUME = (
    *LAUNCH_ONLY,
    "trainer.total_steps",  # extends (or shortens) the run; see lr_decay_steps in the message
    "trainer.save_every", "trainer.keep_last", "trainer.save_hf_every", "trainer.async_save",
    "cluster.", "metrics.", "notify.", "debug.",
)
"""Keys (or `section.` prefixes) a resume may change without resume_with_changes=true: they say
where and how the run is launched, watched and checkpointed, or how long it runs, not what a
step computes. Keys ending in `timeout_s` too."""


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old, new) for every leaf present in both configs with another value.

    A key present in only one of them (a config written by an older or newer relax-slurm)
    is not a change: there is nothing to compare it with."""
    a, b = flatten(old), flatten(new)
    return {k: (a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k] != b[k]}


def free_on_resume(key: str) -> bool:
    return key.endswith("timeout_s") or any(
        key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_ON_RESUME)


def fmt(value: Any) -> str:
    if isinstance(value, (list, dict, str)) or value is None:
        return json.dumps(value)
    return str(value)


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {fmt(a)} -> {fmt(b)}" for k, (a, b) in changes.items())


def check_changes(changes: dict[str, tuple[Any, Any]], step: int, allow: bool,
                  total_steps: int | None = None) -> None:
    """ConfigError naming the keys a resume from `step` would change unasked (`total_steps`:
    the run's length, to tell a finished run, which has nothing left to train)."""
    refused = {k: v for k, v in changes.items() if not free_on_resume(k)}
    if not refused or allow:
        return
    if total_steps is not None and step >= total_steps:
        raise ConfigError(
            f"this run is complete (steps 0-{step - 1}, trainer.total_steps={total_steps}) "
            f"and was trained with another config: {describe(refused)}; nothing is left to "
            "train with them. Fix: drop those overrides to see its summary; or raise "
            "trainer.total_steps with resume_with_changes=true to train further with the new "
            "values; or a new run_dir (or resume=none overwrite=true) to start over with them")
    raise ConfigError(
        f"this run already trained steps 0-{step - 1} with another config; resuming from "
        f"step_{step} would train the rest with: {describe(refused)}. Fix: drop those overrides "
        "to continue as it ran; or resume_with_changes=true to continue with the new values "
        f"(recorded in {HISTORY_FILE}); or a new run_dir (or resume=none overwrite=true) to "
        "start over with them")


def check_warm_start(changes: dict[str, tuple[Any, Any]], resume_from: Path) -> None:
    """An SFT checkpoint resumed as RL (or an RL one as SFT) is a warm start, not a resume:
    it would carry the step count, optimizer state and lr schedule across. Refused whatever
    resume_with_changes says, naming the HF export to start from instead."""
    old, new = changes.get("algo.name", (None, None))
    if old is None or (old in SUPERVISED_ALGOS) == (new in SUPERVISED_ALGOS):
        return
    export = resume_from.parent.parent / "hf" / resume_from.name
    raise ConfigError(
        f"{resume_from} is a checkpoint of an algo={old} run and this run is algo={new}: "
        "starting one from the other is a warm start, not a resume (it would carry the step "
        "count, optimizer state and lr schedule across). Fix: start from its Hugging Face "
        f"export, model.path={export} (written at its last step; relax-convert makes one from "
        "any checkpoint), without resume=")


def append_history(run_dir: Path, from_step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """One line per start that changed the config, and the first start (no changes; a fresh
    start begins the file anew): steps from `from_step` on ran with the config of that line
    and the lines before it applied in order."""
    row = {"from_step": from_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()}}
    with (run_dir / HISTORY_FILE).open("a" if from_step else "w") as f:
        f.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class Rerun:
    resume_from: Path | None
    """The checkpoint this start resumes from; None: a fresh start."""
    step: int
    """Its step (0 when fresh)."""
    complete: bool
    """The checkpoint already reached trainer.total_steps: nothing to train."""
    changes: dict[str, tuple[Any, Any]]
    """Keys this start changes against the config the checkpoint's steps ran with."""

    def message(self, cfg: TrainConfig, run_dir: Path) -> str | None:
        total = cfg.trainer.total_steps
        if self.complete:
            return (f"run complete at step {self.step} (trainer.total_steps={total}) in "
                    f"{run_dir}: nothing to do; its summary is {run_dir / 'summary.json'}. To "
                    f"train further raise trainer.total_steps; to start over resume=none "
                    "overwrite=true")
        if self.resume_from is None:
            return None
        text = f"resuming from {self.resume_from} (step {self.step} of {total})"
        if self.changes:
            text += f"; config changes from step {self.step} on: {describe(self.changes)}"
        if ("trainer.total_steps" in self.changes and cfg.trainer.lr_schedule != "constant"
                and cfg.trainer.lr_decay_steps is None):
            old = self.changes["trainer.total_steps"][0]
            text += (f"; the {cfg.trainer.lr_schedule} lr decay now spans {total} steps "
                     f"(trainer.lr_decay_steps={old} keeps the old one)")
        return text


def _reference_config(run_dir: Path, resume_from: Path) -> Path | None:
    """The config the checkpoint's steps ran with: its own run directory's config.yaml (this
    run_dir's, unless resume= names another run's checkpoint)."""
    for candidate in (resume_from.parent.parent / CONFIG_FILE, run_dir / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    return None


def plan_rerun(cfg: TrainConfig, run_dir: Path) -> Rerun:
    """What this start of the run does, checked before anything starts: raises ConfigError
    for a resume that would change the config unasked; records the config history."""
    resume = resolve_resume(run_dir, cfg.resume, cfg.overwrite)
    step = (parse_step(resume) or 0) if resume is not None else 0
    new = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    changes: dict[str, tuple[Any, Any]] = {}
    ref = _reference_config(run_dir, resume) if resume is not None else None
    if ref is not None:
        saved = OmegaConf.load(ref)
        if isinstance(saved, DictConfig):
            move_old_keys(saved)  # written by an older relax-slurm: compare key by key
        old = OmegaConf.to_container(saved, resolve=True)
        changes = {k: v for k, v in config_changes(old, new).items() if k not in LAUNCH_ONLY}
        check_warm_start(changes, resume)
        check_changes(changes, step, cfg.resume_with_changes, cfg.trainer.total_steps)
    rerun = Rerun(resume, step, resume is not None and step >= cfg.trainer.total_steps, changes)
    history = run_dir / HISTORY_FILE
    if not rerun.complete and (resume is None or changes or not history.exists()):
        run_dir.mkdir(parents=True, exist_ok=True)
        append_history(run_dir, step, changes)
    return rerun
