"""Conversion outputs: written to `OUT.tmp/`, renamed to `OUT/` at the end (readable as the
user's umask says); tensor names in natural order; progress bars."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from relax_slurm.checkpoint.resume import CheckpointError

def check_output(out: Path, overwrite: bool) -> None:
    """CheckpointError for a non-empty `out` without `overwrite`: relax-convert checks it
    before it reads the input (a large checkpoint takes minutes), start_output again."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--output {out} exists and is not empty. Fix: choose another "
                              "--output or pass --overwrite")


def start_output(out: Path, overwrite: bool) -> Path:
    check_output(out, overwrite)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_output(tmp: Path, out: Path) -> Path:
    # safetensors (and transformers' save_pretrained through it) create their files 0600:
    # give every output file the mode the user's umask gives new files, so that a converted
    # model on a shared cluster is readable by whoever may read the directory
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)
    if out.exists():
        doomed = out.with_name(out.name + ".del")
        shutil.rmtree(doomed, ignore_errors=True)
        out.rename(doomed)
        shutil.rmtree(doomed)
    tmp.rename(out)
    return out


def natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def progress_bar(enabled: bool, total: int, desc: str, unit: str = "tensor"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)
