"""Hugging Face directories: safetensors shards (+ index), config.json, tokenizer and generation
config, as transformers and SGLang load them; written and read here."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from relax_slurm.checkpoint.outputs import finish_output, natural_key, progress_bar, start_output

log = logging.getLogger("relax_slurm.checkpoint")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DEFAULT_SHARD_MB = 5000.0  # as transformers' max_shard_size="5GB"


ASSET_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json", "preprocessor_config.json",
    "processor_config.json", "*.py",
    # Qwen2.5-Omni's speakers: transformers' from_pretrained of it refuses a directory without
    "spk_dict.pt",
)


def hf_weight_files(p: Path) -> list[Path]:
    files = sorted(p.glob("*.safetensors"))
    return files or sorted(p.glob("pytorch_model*.bin"))


def file_shapes(f: Path) -> dict[str, tuple[int, ...]]:
    """One weight file's tensor shapes without reading its tensors: a safetensors header, or a
    .bin file mapped (torch.load mmap)."""
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            return {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
    state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    return {name: tuple(t.shape) for name, t in state.items()}


def weight_shapes(p: Path) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in a HF directory (file_shapes of each of its weight files)."""
    return {name: shape for f in hf_weight_files(Path(p)) for name, shape in file_shapes(f).items()}


def write_hf_dir(tensors: dict[str, torch.Tensor], config, out_dir: str | Path,
                 assets_src: str | Path | None, dtype: torch.dtype | None = None,
                 names_model: nn.Module | None = None, progress: bool = False,
                 shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = True) -> Path:
    """Write `tensors` (HF names, aliases already removed) as a transformers/SGLang-loadable
    directory: safetensors shards (+ index), config.json, tokenizer and generation config."""
    if names_model is not None:
        tensors = revert_weight_conversion(names_model, tensors)
    config = copy.deepcopy(config)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        set_config_dtype(config, dtype)
    bar = progress_bar(progress, len(tensors), "write safetensors")
    named = ((name, tensors[name]) for name in sorted(tensors, key=natural_key))
    try:
        return write_hf_stream(named, config, out_dir, assets_src, shard_size_mb, overwrite,
                               on_tensor=lambda: bar.update(1), copy=False)
    finally:
        bar.close()


def write_hf_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], config,
                    out_dir: str | Path, assets_src: str | Path | None,
                    shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = True,
                    on_tensor: Callable[[], None] = lambda: None, copy: bool = True) -> Path:
    """write_hf_dir of tensors as they come (an exporter's generator), each shard written once
    full: at most one shard is held, never the whole model. copy=False: the caller keeps every
    tensor unchanged until the end (a dict it holds anyway)."""
    out = Path(out_dir)
    tmp = start_output(out, overwrite)
    writer = ShardWriter(tmp, shard_size_mb, copy)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
        on_tensor()
    writer.finish()
    config.save_pretrained(tmp)
    if assets_src is not None:
        copy_hf_assets(assets_src, tmp, include_config=False)
    return finish_output(tmp, out)


class ShardWriter:
    """Safetensors shards of at most `shard_size_mb` each (a tensor larger than that alone in
    its shard), written as they fill, then named as transformers names them
    (model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json)."""

    def __init__(self, folder: Path, shard_size_mb: float, copy: bool = True) -> None:
        self.folder, self.limit, self.copy = folder, int(shard_size_mb * 2**20), copy
        self._part: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.peak_held = 0
        """The most bytes held at once (a test's measure of what streaming saves)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._part and self._size + nbytes > self.limit:
            self._flush()
        # a copy: an exporter may hand out views of a buffer it reuses for the next tensor
        self._part[name] = tensor.detach().to("cpu", copy=self.copy).contiguous()
        self._size += nbytes
        self.peak_held = max(self.peak_held, self._size)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"part-{len(self._files):05d}.safetensors"
        save_file(self._part, str(path), metadata={"format": "pt"})
        self._files.append((path, list(self._part)))
        self.total += self._size
        self._part, self._size = {}, 0

    def finish(self) -> None:
        if self._part or not self._files:
            self._flush()
        n = len(self._files)
        weight_map = {}
        for i, (path, names) in enumerate(self._files):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / fname)
            weight_map.update({k: fname for k in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2) + "\n")


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


def set_config_dtype(config, dtype: torch.dtype) -> None:
    config.dtype = dtype
    if not isinstance(getattr(type(config), "torch_dtype", None), property):
        config.torch_dtype = dtype  # transformers < 4.56 knows only this name


def revert_weight_conversion(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """transformers 5 may load weights under other names (fused MoE experts): undo that as
    save_pretrained does, so the files keep the original layout. A no-op for dense models."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, dict(tensors))


def read_hf(src: Path, progress: bool) -> dict[str, torch.Tensor]:
    files = hf_weight_files(src)
    out: dict[str, torch.Tensor] = {}
    bar = progress_bar(progress, len(files), "read safetensors", unit="file")
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
