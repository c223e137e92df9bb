"""Megatron distributed checkpoints -> Hugging Face: a trainer=megatron checkpoint through the
converter that backend registers (an entry point, so checkpoint/ imports no trainer code),
others through megatron-bridge's export; a trainer=megatron model.lora checkpoint's adapter
through the reader beside that converter (`megatron_adapter`), for from_lora.py to write."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Callable

import torch

from relax_slurm.checkpoint.hf_files import copy_hf_assets
from relax_slurm.checkpoint.outputs import finish_output, start_output
from relax_slurm.checkpoint.resume import META, CheckpointError

CONVERTERS = "relax_slurm.checkpoint_converters"
"""Entry-point group where a trainer backend registers the converter of the checkpoints it
writes (setup.cfg: megatron = relax_slurm.trainer.megatron.convert:dist_checkpoint_to_hf), so
checkpoint/ finds it without importing trainer code."""


ADAPTER_READERS = "relax_slurm.checkpoint_adapter_readers"
"""Entry-point group where a trainer backend registers the reader of a model.lora checkpoint's
adapter: (src, hf_config) -> {PEFT saved name: full tensor} (setup.cfg: megatron =
relax_slurm.trainer.megatron.convert:dist_checkpoint_adapter)."""


def _entry(group: str, backend: str, what: str) -> importlib.metadata.EntryPoint:
    for entry in importlib.metadata.entry_points(group=group):
        if entry.name == backend:
            return entry
    raise CheckpointError(
        f"no {what} for trainer={backend} checkpoints is registered (entry-point group "
        f"{group}): the package's metadata is missing or stale; reinstall it "
        "(pip install -e . in a source checkout)")


def backend_converter(backend: str) -> Callable[..., Path]:
    """The converter `backend` registered under CONVERTERS: (src, out, hf_config, dtype,
    progress, overwrite) -> the HF directory."""
    return _entry(CONVERTERS, backend, "converter").load()


def require_bridge(src: Path) -> None:
    """CheckpointError with the install commands where megatron-bridge is missing."""
    try:
        import megatron.core  # noqa: F401
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ImportError("megatron.bridge")
    except ImportError as e:
        raise CheckpointError(
            f"{src} is a Megatron distributed checkpoint; converting it needs "
            "megatron-bridge, which is not installed. Fix: pip install -e '.[gpu]' on a GPU "
            "machine, or pip install -e '.[megatron_cpu]' on CPU, then pip install --no-deps "
            "megatron-bridge==0.3.1 (see docs/backends.md), and run relax-convert again"
        ) from e


def megatron_adapter(src: Path, hf_config: str | Path | None) -> dict[str, torch.Tensor]:
    """{PEFT saved name: full tensor} of a trainer=megatron model.lora checkpoint, read by
    that backend (its model, megatron-bridge's adapters and their export: what an adapter-only
    weight sync sends), on CPU in this process. `hf_config`: the model's HF config when the
    checkpoint has no hf/ copy."""
    require_bridge(src)
    reader = _entry(ADAPTER_READERS, "megatron", "adapter reader").load()
    return reader(Path(src), hf_config)


def megatron_to_hf(input_dir: str | Path, output_dir: str | Path,
                   hf_config: str | Path | None, progress: bool = False,
                   overwrite: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Through megatron-bridge. A trainer=megatron checkpoint (meta.json says so; it keeps its
    HF config in hf/) is read in this process by the converter that backend registered
    (`backend_converter`), on CPU
    or GPU; other Megatron checkpoints (Megatron-LM / megatron-bridge layouts) go through the
    bridge's export_ckpt and need --hf-config."""
    require_bridge(Path(input_dir))
    src = Path(input_dir)
    if _written_by_megatron_backend(src):
        return backend_converter("megatron")(src, Path(output_dir).resolve(), hf_config, dtype,
                                             progress, overwrite)
    if dtype is not None:
        raise CheckpointError("--dtype is not supported for this Megatron input: megatron-bridge "
                              "exports in the dtype of --hf-config; drop --dtype")
    if hf_config is None:
        raise CheckpointError("a Megatron checkpoint has no Hugging Face config: pass "
                              "--hf-config with the HF model (directory or hub id) it came from")
    from megatron.bridge import AutoBridge

    out = Path(output_dir).resolve()
    tmp = start_output(out, overwrite)
    bridge = AutoBridge.from_hf_pretrained(str(hf_config))
    bridge.export_ckpt(str(input_dir), str(tmp), show_progress=progress)
    copy_hf_assets(hf_config, tmp, include_config=False)
    return finish_output(tmp, out)


def _written_by_megatron_backend(p: Path) -> bool:
    try:
        return json.loads((p / META).read_text()).get("backend") == "megatron"
    except (OSError, ValueError, AttributeError):
        return False
