"""What the tiny presets need, built on first use: `relax-train experiment=tiny_cpu` on a fresh
machine builds tiny/model and tiny/arith_*.jsonl (the commands tools/ runs by hand) before the
run starts, and says so in one line per asset.

Only the files the tiny presets name are built, and only where a run asks for them: a missing
`model.path` or `data.train_files` entry whose folder is called `tiny` and whose name is one of
ASSETS below. Anything else that is missing is reported by the launcher's input checks.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path
from typing import Callable

from relax_slurm.config import TrainConfig
from relax_slurm.errors import DataError


def _model(kind: str) -> Callable[[Path], list[str]]:
    return lambda path: ["relax_slurm.tiny.model", "--out", str(path), "--kind", kind]


def _task(module: str, *args: str) -> Callable[[Path], list[str]]:
    return lambda path: [module, "--out", str(path.parent), *args]


ASSETS: dict[str, Callable[[Path], list[str]]] = {
    # name under tiny/ -> the module and arguments that build it
    "model": _model("text"),
    "moe_model": _model("moe"),
    "vl_model": _model("vl"),
    "vl3_model": _model("vl3"),
    "audio_model": _model("audio"),
    "arith_train.jsonl": _task("relax_slurm.tiny.arith"),
    "arith_test.jsonl": _task("relax_slurm.tiny.arith"),
    "longtail_train.jsonl": _task("relax_slurm.tiny.longtail"),
    "longtail_test.jsonl": _task("relax_slurm.tiny.longtail"),
    "colors_train.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "colors"),
    "colors_test.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "colors"),
    "change_train.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "change"),
    "change_test.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "change"),
    "tones_train.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "tones"),
    "tones_test.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "tones"),
    "sounding_train.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "sounding"),
    "sounding_test.jsonl": _task("relax_slurm.tiny.media_tasks", "--task", "sounding"),
}


def missing_tiny_assets(cfg: TrainConfig) -> list[tuple[Path, list[str]]]:
    """(path, [module, args...]) of every tiny asset the run names and the disk lacks."""
    out: list[tuple[Path, list[str]]] = []
    for name in (cfg.model.path, *cfg.data.train_files):
        path = Path(name)
        build = ASSETS.get(path.name)
        if path.parent.name == "tiny" and build is not None and not path.exists():
            if all(cmd != build(path) for _, cmd in out):  # train and test come together
                out.append((path, build(path)))
    return out


def ensure_tiny_assets(cfg: TrainConfig, say: Callable[[str], None] = print) -> int:
    """Build what missing_tiny_assets names, in this process; how many were built."""
    todo = missing_tiny_assets(cfg)
    for path, (module, *args) in todo:
        say(f"relax-train: {path} does not exist yet: building it (python -m {module} "
            f"{' '.join(args)}; once)")
        out = io.StringIO()  # the builders' own reports and progress bars, shown on failure
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = importlib.import_module(module).main(args)
        except Exception as e:
            raise DataError(f"building {path} failed: python -m {module} {' '.join(args)}: "
                            f"{type(e).__name__}: {e}\n{out.getvalue()[-2000:]}") from e
        if code:
            raise DataError(f"building {path} failed: python -m {module} {' '.join(args)} "
                            f"exited with {code}\n{out.getvalue()[-2000:]}")
    return len(todo)
