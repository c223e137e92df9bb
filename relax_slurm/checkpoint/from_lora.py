"""A model.lora run's DCP checkpoint -> a PEFT adapter directory, or a merged Hugging Face model.

Such a checkpoint holds the trained parameters only (the adapter, under the PEFT model's names:
`base_model.model.<module>.lora_A.default.weight`) and its meta.json the adapter's config with
the base model it adapts (`extra_state["lora"]`, trainer/lora.py `checkpoint_record`).

    --to peft   adapter_config.json + adapter_model.safetensors (PEFT's saved names, without the
                adapter's name): `PeftModel.from_pretrained(base, OUT)` loads it, and so does
                SGLang's --lora-paths
    --to hf     model.path with the adapter merged into its weights (PEFT's merge_and_unload),
                written as any HF export: `AutoModelForCausalLM.from_pretrained(OUT)`
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from relax_slurm.checkpoint.dcp import MODEL_KEY, read_meta
from relax_slurm.checkpoint.from_dcp import read_dcp
from relax_slurm.checkpoint.hf_files import write_hf_dir
from relax_slurm.checkpoint.outputs import finish_output, start_output
from relax_slurm.checkpoint.resume import CheckpointError

LORA_KEY = "lora"
"""meta.json extra_state key of a model.lora checkpoint."""
ADAPTER_NAME = "default"
_NAMED = re.compile(r"\.(lora_[A-Za-z_]+)\." + ADAPTER_NAME + r"(\.|$)")


def lora_record(src: Path) -> dict[str, Any] | None:
    """The adapter's record in a checkpoint's meta.json, or None (not a model.lora run's; a
    Megatron-LM checkpoint has no meta.json)."""
    if not (Path(src) / "meta.json").is_file():
        return None
    return read_meta(src).get("extra_state", {}).get(LORA_KEY)


def peft_names(stored: list[str]) -> dict[str, str]:
    """{PEFT's saved name: the checkpoint's name}: the adapter's name dropped, as PEFT's
    save_pretrained writes them.

    >>> peft_names(["base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"])
    {'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight': 'base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight'}
    """
    return {_NAMED.sub(r".\1\2", name): name for name in stored if _NAMED.search(name)}


def read_adapter(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, {PEFT saved name: tensor}) from a model.lora checkpoint."""
    record = lora_record(src)
    if record is None:
        raise CheckpointError(f"{src} is not a model.lora run's checkpoint (its meta.json has "
                              "no extra_state.lora). Fix: --to hf for a full fine-tuning "
                              "checkpoint")
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    stored = {k[len(MODEL_KEY):]: v for k, v in metadata.items()
              if k.startswith(MODEL_KEY) and isinstance(v, TensorStorageMetadata)}
    names = peft_names(list(stored))
    if not names:
        raise CheckpointError(f"{src}: no adapter tensors (lora_A/lora_B) in the checkpoint")
    tensors = read_dcp(src, {n: stored[n] for n in names.values()}, progress=False)
    config = dict(record["adapter_config"], base_model_name_or_path=record["base_model_path"])
    return config, {peft: tensors[name] for peft, name in names.items()}


def dcp_to_peft(src: Path, output_dir: str | Path, dtype: torch.dtype | None,
                overwrite: bool) -> Path:
    from safetensors.torch import save_file

    config, tensors = read_adapter(src)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out = Path(output_dir)
    tmp = start_output(out, overwrite)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return finish_output(tmp, out)


def untie_head(model) -> None:
    """An adapter on an lm_head tied to embed_tokens adapts the output projection only: the
    merged model gets a head of its own (untied in its config too), the embeddings stay."""
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False


def dcp_lora_to_hf(src: Path, output_dir: str | Path, base: str | Path | None,
                   dtype: torch.dtype | None, progress: bool, shard_size_mb: float,
                   overwrite: bool, trust_remote_code: bool) -> Path:
    """The base model (`base`, default the record's model.path) with the adapter merged."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from relax_slurm.modeling import auto_model_class

    config, tensors = read_adapter(src)
    base_path = base or config["base_model_name_or_path"]
    if not Path(base_path, "config.json").is_file():
        raise CheckpointError(f"the adapter's base model {base_path} is not a Hugging Face "
                              "directory here. Fix: pass --hf-config with model.path's copy")
    model = auto_model_class(str(base_path)).from_pretrained(
        base_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if "lm_head" in config.get("target_modules", []) \
            and getattr(model.config, "tie_word_embeddings", False):
        untie_head(model)
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora",
            "fan_in_fan_out", "init_lora_weights", "task_type")
    peft_model = get_peft_model(model, LoraConfig(**{k: config[k] for k in keys if k in config}))
    result = set_peft_model_state_dict(peft_model, tensors)
    if result.unexpected_keys:
        raise CheckpointError(f"{src}: adapter tensors {result.unexpected_keys[:3]} do not fit "
                              f"{base_path}: is it the run's model.path?")
    merged = peft_model.merge_and_unload()
    weights = {n: p.detach() for n, p in merged.named_parameters()}
    assets = src / "hf" if (src / "hf").is_dir() else base_path
    return write_hf_dir(weights, merged.config, output_dir, assets, dtype, merged, progress,
                        shard_size_mb, overwrite)
