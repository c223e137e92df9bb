"""Checkpoint formats and conversion: our DCP checkpoints <-> Hugging Face safetensors, Megatron
distributed checkpoints -> Hugging Face (through megatron-bridge), and HF exports of a live model.

Conversions run in one process without a process group: DCP reads any world size's shards
(`dcp.load(..., no_dist=True)` reshards into full tensors). Every tensor is checked against the
architecture in the HF config (names and shapes from the model built on the meta device), so a
checkpoint never silently lands in the wrong model. Outputs are written to `OUT.tmp/` and
renamed to `OUT/` at the end.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from relax_slurm.checkpoint.dcp import meta_dict, quiet_single_process
from relax_slurm.checkpoint.resume import (
    DCP_METADATA, META, CheckpointError, find_latest,
)

log = logging.getLogger("relax_slurm.checkpoint")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_MB = 5000.0  # as transformers' max_shard_size="5GB"
READ_CHUNK_BYTES = 1 << 30  # DCP tensors loaded per dcp.load call (bounds the progress step)
MODEL_KEY = "model."  # save_checkpoint's state dict is {"model": ..., "optimizer": ...}
ASSET_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json", "preprocessor_config.json",
    "processor_config.json", "*.py",
)


# ---- format detection -----------------------------------------------------------------------
def detect_format(path: str | Path) -> tuple[str, Path]:
    """("dcp" | "hf" | "megatron", the directory to read). A run directory or its checkpoints/
    resolves to its latest complete checkpoint."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"--input {p}: not a directory")
    if p.name.endswith((".tmp", ".del")):
        raise CheckpointError(f"--input {p} is a save that did not finish (or a deletion): "
                              "use a complete step_<N> directory or the run directory")
    mega = _megatron_dir(p)
    if mega is not None:
        return "megatron", mega
    if (p / DCP_METADATA).is_file():
        return "dcp", p
    if (p / "config.json").is_file() and _hf_weight_files(p):
        return "hf", p
    latest = find_latest(p)
    if latest is not None:  # a run directory: its newest checkpoint, of either backend
        return ("megatron", latest) if _megatron_dir(latest) is not None else ("dcp", latest)
    raise CheckpointError(
        f"--input {p}: no checkpoint format recognised. Expected a DCP checkpoint (.metadata, "
        "e.g. RUN_DIR/checkpoints/step_<N>), a Hugging Face directory (config.json + "
        "*.safetensors), a Megatron checkpoint (iter_*/ with metadata.json), or a run directory"
    )


def _megatron_dir(p: Path) -> Path | None:
    tracker = p / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        iter_dir = p / f"iter_{int(it):07d}" if it.isdigit() else p
        return iter_dir if iter_dir.is_dir() else p
    meta = p / "metadata.json"
    if meta.is_file():
        try:
            if "sharded_backend" in json.loads(meta.read_text()):
                return p
        except (ValueError, TypeError):
            pass
    if any(p.glob("mp_rank_*")) and re.fullmatch(r"iter_\d+|release", p.name):
        return p
    return None


def _hf_weight_files(p: Path) -> list[Path]:
    files = sorted(p.glob("*.safetensors"))
    return files or sorted(p.glob("pytorch_model*.bin"))


# ---- architecture -----------------------------------------------------------------------------
def load_config(src: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CheckpointError(f"cannot read a Hugging Face config from {src}: {e}. Fix: pass "
                              "--hf-config with the model directory the run started from") from e


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The model of `config` on the meta device (no memory): names, shapes and tied weights."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code)


def expected_tensors(model: nn.Module) -> tuple[dict[str, torch.Size], set[str]]:
    """(state-dict name -> shape, names that alias another tensor: tied weights)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    owned = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return shapes, set(shapes) - owned


def check_architecture(
    found: dict[str, torch.Size], expected: dict[str, torch.Size], aliases: set[str], what: str,
    config_src: Any,
    fix: str = "pass --hf-config with the model directory this checkpoint was trained from",
) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped tensors."""
    missing = sorted(set(expected) - set(found) - aliases)
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{k}: {tuple(found[k])} vs {tuple(expected[k])}"
             for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing (e.g. {missing[:3]})" if missing else "",
                 f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})" if unexpected else "",
                 f"{len(wrong)} with other shapes (e.g. {wrong[:3]})" if wrong else ""]
        raise CheckpointError(
            f"{what} does not match the architecture of {config_src}: "
            + "; ".join(p for p in parts if p)
            + f". Fix: {fix}"
        )


def unwrap_model(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# ---- Hugging Face directory writer -------------------------------------------------------------
def write_hf_dir(tensors: dict[str, torch.Tensor], config, out_dir: str | Path,
                 assets_src: str | Path | None, dtype: torch.dtype | None = None,
                 names_model: nn.Module | None = None, progress: bool = False,
                 shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = True) -> Path:
    """Write `tensors` (HF names, aliases already removed) as a transformers/SGLang-loadable
    directory: safetensors shards (+ index), config.json, tokenizer and generation config."""
    out = Path(out_dir)
    tmp = _start_output(out, overwrite)
    if names_model is not None:
        tensors = _revert_weight_conversion(names_model, tensors)
    config = copy.deepcopy(config)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        _set_config_dtype(config, dtype)
    names = sorted(tensors, key=_natural_key)
    shards: list[list[str]] = [[]]
    size, limit = 0, int(shard_size_mb * 2**20)
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    _write_shards(tensors, shards, tmp, progress)
    config.save_pretrained(tmp)
    if assets_src is not None:
        copy_hf_assets(assets_src, tmp, include_config=False)
    return _finish_output(tmp, out)


def _write_shards(tensors: dict[str, torch.Tensor], shards: list[list[str]], tmp: Path,
                  progress: bool) -> None:
    from safetensors.torch import save_file

    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    bar = _bar(progress, len(tensors), "write safetensors")
    for fname, shard in zip(files, shards):
        part = {k: tensors[k].detach().contiguous().cpu() for k in shard}
        save_file(part, str(tmp / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update({k: fname for k in shard})
        bar.update(len(shard))
    bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_hf_assets(src: str | Path, dst: str | Path, include_config: bool = True) -> None:
    """Tokenizer, generation config and remote code of a model dir (or hub id) into dst."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():  # a hub id: let transformers fetch what it needs
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(str(src)).save_pretrained(dst)
        except Exception as e:  # conversion still useful without; say so
            log.warning("could not copy the tokenizer of %s: %s", src, e)
        return
    patterns = ASSET_PATTERNS + (("config.json",) if include_config else ())
    for pattern in patterns:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, dst / f.name)


def _set_config_dtype(config, dtype: torch.dtype) -> None:
    config.dtype = dtype
    if not isinstance(getattr(type(config), "torch_dtype", None), property):
        config.torch_dtype = dtype  # transformers < 4.56 knows only this name


def _revert_weight_conversion(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """transformers 5 may load weights under other names (fused MoE experts): undo that as
    save_pretrained does, so the files keep the original layout. A no-op for dense models."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, dict(tensors))


# ---- DCP -> HF ----------------------------------------------------------------------------------
def dcp_to_hf(input_dir: str | Path, output_dir: str | Path, hf_config: str | Path | None = None,
              dtype: torch.dtype | None = None, progress: bool = False,
              shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = False,
              trust_remote_code: bool = False) -> Path:
    src = Path(input_dir)
    config_src = hf_config or _dcp_config_source(src)
    config = load_config(config_src, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    expected, aliases = expected_tensors(model)
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    stored = {k[len(MODEL_KEY):]: v for k, v in metadata.items()
              if k.startswith(MODEL_KEY) and isinstance(v, TensorStorageMetadata)}
    check_architecture({k: v.size for k, v in stored.items()}, expected, aliases,
                       f"checkpoint {src}", config_src)
    wanted = [k for k in sorted(expected, key=_natural_key) if k not in aliases]
    tensors = _read_dcp(src, {k: stored[k] for k in wanted}, progress)
    assets = hf_config or (src / "hf" if (src / "hf").is_dir() else config_src)
    return write_hf_dir(tensors, config, output_dir, assets, dtype, model, progress,
                        shard_size_mb, overwrite)


def _dcp_config_source(src: Path) -> str | Path:
    if (src / "hf" / "config.json").is_file():
        return src / "hf"
    try:
        path = json.loads((src / META).read_text())["extra_state"]["config"]["model"]["path"]
        return path
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{src} holds no Hugging Face config (no hf/config.json, no model.path in "
            f"{META}). Fix: pass --hf-config with the model directory the run started from"
        ) from None


def _read_dcp(src: Path, items: dict[str, TensorStorageMetadata],
              progress: bool) -> dict[str, torch.Tensor]:
    """Full tensors of `items` (model names), READ_CHUNK_BYTES per dcp.load call."""
    out = {name: torch.empty(md.size, dtype=md.properties.dtype) for name, md in items.items()}
    bar = _bar(progress, len(out), "read dcp")
    chunk: dict[str, torch.Tensor] = {}
    nbytes = 0
    for i, (name, t) in enumerate(out.items()):
        chunk[MODEL_KEY + name] = t
        nbytes += t.numel() * t.element_size()
        if nbytes >= READ_CHUNK_BYTES or i == len(out) - 1:
            with quiet_single_process():
                dcp.load(chunk, storage_reader=FileSystemReader(src), no_dist=True)
            bar.update(len(chunk))
            chunk, nbytes = {}, 0
    bar.close()
    return out


# ---- HF -> DCP ----------------------------------------------------------------------------------
def hf_to_dcp(input_dir: str | Path, output_dir: str | Path, dtype: torch.dtype | None = None,
              progress: bool = False, overwrite: bool = False,
              trust_remote_code: bool = False) -> Path:
    """A weights-only checkpoint, loadable by `load_checkpoint` (resume=PATH) on any world size."""
    src, out = Path(input_dir), Path(output_dir).resolve()
    config = load_config(src, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    expected, aliases = expected_tensors(model)
    tensors = _read_hf(src, progress)
    for alias in aliases & set(tensors):  # some checkpoints store tied copies: the source wins
        del tensors[alias]
    check_architecture({k: v.shape for k, v in tensors.items()}, expected, aliases,
                       f"Hugging Face weights in {src}", src / "config.json",
                       fix="repair config.json or the weight files; they must describe one model")
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        _set_config_dtype(config, dtype)
    # the trainer's state dict names tied weights twice (same tensor): so does this checkpoint
    model_sd = dict(tensors)
    model_sd.update({alias: tensors[source] for alias, source in
                     _tied_sources(model, aliases).items()})
    tmp = _start_output(out, overwrite)
    with quiet_single_process():
        dcp.save({MODEL_KEY[:-1]: model_sd}, storage_writer=FileSystemWriter(tmp, overwrite=True),
                 no_dist=True)
    (tmp / "hf").mkdir()
    config.save_pretrained(tmp / "hf")
    copy_hf_assets(src, tmp / "hf", include_config=False)
    meta = meta_dict(0, {"source": str(src.resolve())}, weights_only=True)
    meta["world_size"] = 1
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    return _finish_output(tmp, out)


def _tied_sources(model: nn.Module, aliases: set[str]) -> dict[str, str]:
    """alias name -> the parameter it shares storage with (by identity on the meta model)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    by_id.update({id(b): n for n, b in model.named_buffers()})
    sd = model.state_dict(keep_vars=True)
    return {a: by_id[id(sd[a])] for a in aliases}


def _read_hf(src: Path, progress: bool) -> dict[str, torch.Tensor]:
    files = _hf_weight_files(src)
    out: dict[str, torch.Tensor] = {}
    bar = _bar(progress, len(files), "read safetensors", unit="file")
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        else:
            out.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        bar.update(1)
    bar.close()
    return out


# ---- Megatron -> HF -----------------------------------------------------------------------------
CONVERTERS = "relax_slurm.checkpoint_converters"
"""Entry-point group where a trainer backend registers the converter of the checkpoints it
writes (setup.cfg: megatron = relax_slurm.trainer.megatron.convert:dist_checkpoint_to_hf), so
checkpoint/ finds it without importing trainer code."""


def backend_converter(backend: str) -> Callable[..., Path]:
    """The converter `backend` registered under CONVERTERS: (src, out, hf_config, dtype,
    progress, overwrite) -> the HF directory."""
    for entry in importlib.metadata.entry_points(group=CONVERTERS):
        if entry.name == backend:
            return entry.load()
    raise CheckpointError(
        f"no converter for trainer={backend} checkpoints is registered (entry-point group "
        f"{CONVERTERS}): the package's metadata is missing or stale; reinstall it "
        "(pip install -e . in a source checkout)")


def megatron_to_hf(input_dir: str | Path, output_dir: str | Path,
                   hf_config: str | Path | None, progress: bool = False,
                   overwrite: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Through megatron-bridge. A trainer=megatron checkpoint (meta.json says so; it keeps its
    HF config in hf/) is read in this process by the converter that backend registered
    (`backend_converter`), on CPU
    or GPU; other Megatron checkpoints (Megatron-LM / megatron-bridge layouts) go through the
    bridge's export_ckpt and need --hf-config."""
    try:
        import megatron.core  # noqa: F401
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ImportError("megatron.bridge")
    except ImportError as e:
        raise CheckpointError(
            f"{input_dir} is a Megatron distributed checkpoint; converting it needs "
            "megatron-bridge, which is not installed. Fix: pip install -e '.[gpu]' on a GPU "
            "machine, or pip install -e '.[megatron_cpu]' on CPU, then pip install --no-deps "
            "megatron-bridge==0.3.1 (see docs/backends.md), and run relax-convert again"
        ) from e
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
    tmp = _start_output(out, overwrite)
    bridge = AutoBridge.from_hf_pretrained(str(hf_config))
    bridge.export_ckpt(str(input_dir), str(tmp), show_progress=progress)
    copy_hf_assets(hf_config, tmp, include_config=False)
    return _finish_output(tmp, out)


def _written_by_megatron_backend(p: Path) -> bool:
    try:
        return json.loads((p / META).read_text()).get("backend") == "megatron"
    except (OSError, ValueError, AttributeError):
        return False


# ---- dispatch -----------------------------------------------------------------------------------
def convert_checkpoint(
    input_dir: str | Path, output_dir: str | Path, to: str | None = None,
    dtype: str | None = None, hf_config: str | Path | None = None, progress: bool = False,
    overwrite: bool = False, shard_size_mb: float = DEFAULT_SHARD_MB,
    trust_remote_code: bool = False,
) -> Path:
    """Detect the input's format and convert: dcp -> hf, hf -> dcp, megatron -> hf."""
    fmt, src = detect_format(input_dir)
    target = to or ("dcp" if fmt == "hf" else "hf")
    if target == fmt:
        raise CheckpointError(f"--input {src} is already in {fmt} format; --to {target} would "
                              "copy it. Fix: --to " + ("hf" if fmt == "dcp" else "dcp"))
    torch_dtype = None if dtype in (None, "auto") else DTYPES.get(dtype)
    if dtype not in (None, "auto") and torch_dtype is None:
        raise CheckpointError(f"--dtype {dtype}: use auto, {', '.join(DTYPES)}")
    if fmt == "megatron":
        if target != "hf":
            raise CheckpointError("a Megatron checkpoint converts to hf only: --to hf")
        return megatron_to_hf(src, output_dir, hf_config, progress, overwrite, torch_dtype)
    if fmt == "dcp":
        return dcp_to_hf(src, output_dir, hf_config, torch_dtype, progress, shard_size_mb,
                         overwrite, trust_remote_code)
    return hf_to_dcp(src, output_dir, torch_dtype, progress, overwrite, trust_remote_code)


# ---- HF export of a live model ------------------------------------------------------------------
def save_hf(model: nn.Module, hf_assets_src: str | Path | None, out_dir: str | Path,
            dtype: torch.dtype | str | None = None,
            shard_size_mb: float = DEFAULT_SHARD_MB) -> Path | None:
    """Export the training model as a Hugging Face directory (for evaluation or serving).

    Call it on every rank: under FSDP2 the full tensors are gathered (a collective); rank 0
    writes `out_dir` atomically (replacing an older export) and gets its path, others get None.
    Works on a bare model, DDP and FSDP2. `hf_assets_src` supplies tokenizer/generation config.
    """
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else DTYPES[dtype]
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    base = unwrap_model(model)
    owned = {n for n, _ in base.named_parameters()} | {n for n, _ in base.named_buffers()}
    tensors = {k: v for k, v in full.items() if k in owned}
    return write_hf_dir(tensors, base.config, out_dir, hf_assets_src, dtype, base,
                        shard_size_mb=shard_size_mb, overwrite=True)


# ---- output directories -------------------------------------------------------------------------
def _start_output(out: Path, overwrite: bool) -> Path:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--output {out} exists and is not empty. Fix: choose another "
                              "--output or pass --overwrite")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish_output(tmp: Path, out: Path) -> Path:
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


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _bar(enabled: bool, total: int, desc: str, unit: str = "tensor"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)
