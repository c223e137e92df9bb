"""A model.lora run's checkpoint -> a PEFT adapter directory, or a merged Hugging Face model.

A trainer=torch checkpoint (DCP) holds the trained parameters only (the adapter, under the PEFT
model's names: `base_model.model.<module>.lora_A.default.weight`); a trainer=megatron one
(Megatron's dist-checkpoint) holds megatron-bridge's adapters, which that backend's reader turns
into the same PEFT names (checkpoint/from_megatron.py `megatron_adapter`). Both keep in meta.json
the adapter's config with the base model it adapts (`extra_state["lora"]`,
trainer/lora.py `checkpoint_record`). Once read, both are written by the same two functions:

    --to peft   adapter_config.json + adapter_model.safetensors (PEFT's saved names, without the
                adapter's name): `PeftModel.from_pretrained(base, OUT)` loads it, and so does
                SGLang's --lora-paths (`write_peft`)
    --to hf     model.path with the adapter merged into its weights (PEFT's merge_and_unload),
                written as any HF export: `AutoModelForCausalLM.from_pretrained(OUT)`
                (`write_merged`)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from relax_slurm.checkpoint.dcp import HF_ASSETS, MODEL_KEY, read_meta
from relax_slurm.checkpoint.from_dcp import read_dcp
from relax_slurm.checkpoint.hf_files import write_hf_dir
from relax_slurm.checkpoint.outputs import finish_output, start_output
from relax_slurm.checkpoint.resume import META, CheckpointError

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


def adapter_config(src: Path) -> dict[str, Any]:
    """PEFT's adapter_config.json of a model.lora checkpoint: the recorded config, its base the
    recorded model.path."""
    record = lora_record(src)
    if record is None:
        raise CheckpointError(f"{src} is not a model.lora run's checkpoint (its meta.json has "
                              "no extra_state.lora). Fix: --to hf for a full fine-tuning "
                              "checkpoint")
    return dict(record["adapter_config"], base_model_name_or_path=record["base_model_path"])


def read_adapter(src: Path) -> dict[str, torch.Tensor]:
    """{PEFT saved name: tensor} of a trainer=torch model.lora checkpoint (DCP)."""
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    stored = {k[len(MODEL_KEY):]: v for k, v in metadata.items()
              if k.startswith(MODEL_KEY) and isinstance(v, TensorStorageMetadata)}
    names = peft_names(list(stored))
    if not names:
        raise CheckpointError(f"{src}: no adapter tensors (lora_A/lora_B) in the checkpoint")
    tensors = read_dcp(src, {n: stored[n] for n in names.values()}, progress=False)
    return {peft: tensors[name] for peft, name in names.items()}


def write_peft(config: dict[str, Any], tensors: dict[str, torch.Tensor],
               output_dir: str | Path, dtype: torch.dtype | None, overwrite: bool) -> Path:
    """adapter_config.json + adapter_model.safetensors, as PEFT's save_pretrained writes them."""
    from safetensors.torch import save_file

    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out = Path(output_dir)
    tmp = start_output(out, overwrite)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return finish_output(tmp, out)


def base_model_dir(src: Path, config: dict[str, Any], base: str | Path | None) -> Path:
    """The HF directory the adapter merges into: `base` (--hf-config), else the model.path
    recorded in the checkpoint's meta.json, which must still be there. Checked before the
    checkpoint is read (a megatron one takes a model build)."""
    if base is not None:
        if not Path(base, "config.json").is_file():
            raise CheckpointError(f"--hf-config {base} is not a Hugging Face directory (no "
                                  "config.json). Fix: --hf-config with a copy of the run's "
                                  "model.path")
        return Path(base)
    recorded = Path(config["base_model_name_or_path"])
    if not (recorded / "config.json").is_file():
        raise CheckpointError(
            f"{src / META} records the adapter's base model as {recorded}, which is not a "
            "Hugging Face directory here (no config.json): --to hf merges the adapter into "
            "it. Fix: --hf-config with a copy of that model, or --to peft (the adapter alone "
            "needs no base)")
    return recorded


def untie_head(model) -> None:
    """An adapter on an lm_head tied to embed_tokens adapts the output projection only: the
    merged model gets a head of its own (untied in its config too), the embeddings stay."""
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False


def write_merged(src: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 base_path: Path, output_dir: str | Path, dtype: torch.dtype | None,
                 progress: bool, shard_size_mb: float, overwrite: bool,
                 trust_remote_code: bool) -> Path:
    """The base model with the adapter merged by PEFT (merge_and_unload), as an HF directory
    (tokenizer and configs from the checkpoint's hf/ copy, else the base's)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from relax_slurm.modeling import auto_model_class

    model = auto_model_class(str(base_path)).from_pretrained(
        base_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if "lm_head" in config.get("target_modules", []) \
            and getattr(model.config, "tie_word_embeddings", False):
        untie_head(model)
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora",
            "fan_in_fan_out", "init_lora_weights", "task_type")
    peft_model = get_peft_model(model, LoraConfig(**{k: config[k] for k in keys if k in config}))
    result = set_peft_model_state_dict(peft_model, tensors)
    # every adapter tensor must find its module and every module its tensors: an adapter left
    # as PEFT initialised it (B zero) would merge as nothing, silently
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise CheckpointError(f"{src}: the adapter does not fit {base_path} (tensors without a "
                              f"module: {result.unexpected_keys[:3]}, modules without tensors: "
                              f"{missing[:3]}). Fix: --hf-config with the run's model.path")
    merged = peft_model.merge_and_unload()
    weights = {n: p.detach() for n, p in merged.named_parameters()}
    assets = src / HF_ASSETS if (src / HF_ASSETS).is_dir() else base_path
    return write_hf_dir(weights, merged.config, output_dir, assets, dtype, merged, progress,
                        shard_size_mb, overwrite)
