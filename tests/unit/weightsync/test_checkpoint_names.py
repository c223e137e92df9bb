"""transformers 5 loads Qwen2.5-VL under new names (`model.language_model.*`, `model.visual.*`)
from files with the old ones (`model.*`, `visual.*`). megatron-bridge exports, and SGLang loads,
the files' names: the hf engine receives under both (relax_slurm.modeling.checkpoint_names)."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from relax_slurm.weightsync.receiver import load_named_tensors, parameter_views


def test_qwen25_vl_receives_the_checkpoint_files_names(tiny_mm_assets):
    d = tiny_mm_assets / "vl_model"
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    params = dict(model.named_parameters())
    views = parameter_views(model)
    on_file = load_file(str(d / "model.safetensors"))
    assert set(on_file) <= set(views)  # every name the file has, e.g. visual.*, model.layers.*
    assert views["visual.patch_embed.proj.weight"] is params["model.visual.patch_embed.proj.weight"]
    assert (views["model.layers.0.self_attn.q_proj.weight"]
            is params["model.language_model.layers.0.self_attn.q_proj.weight"])
    new = {k: torch.full_like(t, 0.5) for k, t in on_file.items()}
    load_named_tensors(model, new.items())  # received under the files' names
    assert torch.equal(params["model.language_model.embed_tokens.weight"],
                       new["model.embed_tokens.weight"])


def test_qwen3_vl_names_need_no_alias(tiny_mm_assets):
    d = tiny_mm_assets / "vl3_model"
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    assert set(load_file(str(d / "model.safetensors"))) <= set(dict(model.named_parameters()))
