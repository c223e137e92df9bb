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


def test_an_engine_serving_adapters_receives_base_weights_under_their_own_names(tiny_assets):
    """PEFT wraps each targeted layer (`q_proj.weight` becomes `q_proj.base_layer.weight`) when
    the hf engine loads an adapter; a full-weight update names the model's own parameters, as
    SGLang with --enable-lora takes them with adapters loaded."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    d = tiny_assets / "model"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj", "down_proj"]), model,
                            adapter_name="v1")
    params = dict(model.named_parameters())
    assert "model.layers.0.self_attn.q_proj.weight" not in params  # wrapped
    on_file = load_file(str(d / "model.safetensors"))
    new = {k: torch.full_like(t, 0.25) for k, t in on_file.items()}
    load_named_tensors(model, new.items())
    assert torch.equal(params["model.layers.0.self_attn.q_proj.base_layer.weight"],
                       new["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(params["model.layers.0.mlp.down_proj.base_layer.weight"],
                       new["model.layers.0.mlp.down_proj.weight"])
    lora_a = params["model.layers.0.self_attn.q_proj.lora_A.v1.weight"]
    assert not torch.equal(lora_a, torch.full_like(lora_a, 0.25))  # the adapter untouched
