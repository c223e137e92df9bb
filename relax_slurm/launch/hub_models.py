"""Model paths given as Hugging Face Hub ids (`model.path=Qwen/Qwen3-4B`, as the GPU presets
ship): resolved, before anything starts, to that model's snapshot in this machine's Hugging
Face cache (`hf download Qwen/Qwen3-4B` put it there; HF_HOME / HF_HUB_CACHE move it), and
the run's config.yaml keeps the snapshot's directory, so every role, restart and resume reads
the same files.

Nothing is downloaded: compute nodes usually have no network, and a download of tens of GB
belongs to the user, once, where every node sees it. An id that is not cached is refused with
the command that fetches it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from relax_slurm.errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`org/name`: what a Hub id looks like (a path that exists here is always taken as a path)."""


def resolve_hub_id(value: str | None, key: str) -> str | None:
    """The cached snapshot directory of Hub id `value`; None when `value` is unset, a path
    here or not shaped like an id. Raises ConfigError, naming `key` and the download, for an
    id not cached."""
    if not value or Path(value).exists() or not HUB_ID.fullmatch(value):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(value, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError):  # ValueError: not a valid id after all
        name = value.split("/")[-1]
        raise ConfigError(
            f"{key}={value}: no such directory here, and as a Hugging Face Hub id it is not in "
            f"this machine's cache ({constants.HF_HUB_CACHE}). relax-train downloads nothing "
            "(compute nodes usually have no network): download it once where every node sees "
            f"it, `hf download {value} --local-dir /shared/models/{name}`, and set "
            f"{key}=/shared/models/{name}; or `hf download {value}` into the cache (on Slurm, "
            "with HF_HOME on a shared filesystem)") from None


def resolve_model_paths(cfg, say: Callable[[str], None]) -> None:
    """Every model path of the run that is a cached Hub id becomes its snapshot directory."""
    fields = [("model.path", cfg.model, "path"),
              ("algo.teacher_model_path", cfg.algo, "teacher_model_path"),
              ("reward.genrm_model_path", cfg.reward, "genrm_model_path")]
    for key, section, name in fields:
        value = getattr(section, name)
        snapshot = resolve_hub_id(value, key)
        if snapshot is not None:
            setattr(section, name, snapshot)
            say(f"{key}={value}: the Hugging Face cache's snapshot {snapshot}")
