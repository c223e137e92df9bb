"""Which names the engines take (weightsync/names.py), on the tiny models' real checkpoint
files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from relax_slurm.errors import ConfigError
from relax_slurm.weightsync.adapter import Adapter
from relax_slurm.weightsync.names import NameCheck, known_to_engines


def test_the_files_names_pass_and_transformers_in_memory_names_do_not(tiny_mm_assets):
    """Qwen2.5-VL: transformers 5 holds `model.language_model.*` in memory, the files (and
    SGLang) `model.*`."""
    check = NameCheck(tiny_mm_assets / "vl_model")
    for name in load_file(str(tiny_mm_assets / "vl_model" / "model.safetensors")):
        check.check(name)
    with pytest.raises(ConfigError) as e:
        check.check("model.language_model.layers.0.mlp.down_proj.weight")
    message = str(e.value)
    assert "'model.language_model.layers.0.mlp.down_proj.weight'" in message
    assert "(the files hold e.g. 'model.layers.0.mlp.down_proj.weight')" in message
    assert "model.path=" in message and "off-policy" in message


def test_per_expert_names_of_fused_experts_on_file_and_an_untied_head_pass():
    on_file = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
               "model.embed_tokens.weight"}
    for kind in ("gate_proj", "up_proj", "down_proj"):
        assert known_to_engines(f"model.layers.0.mlp.experts.3.{kind}.weight", on_file)
    assert not known_to_engines("model.layers.1.mlp.experts.3.gate_proj.weight", on_file)
    assert not known_to_engines("model.layers.0.mlp.experts.3.gate_proj.bias", on_file)
    # a tied checkpoint stores no head; SGLang skips the name (the embedding is the head)
    assert known_to_engines("lm_head.weight", on_file)


def test_a_stream_is_checked_as_it_comes_and_a_list_at_once(tiny_assets, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    tensors = load_file(str(tiny_assets / "model" / "model.safetensors"))
    save_file(tensors, str(model / "model.safetensors"))
    check = NameCheck(model)
    named = [*tensors.items(), ("model.norm.weight_renamed", torch.zeros(1))]
    seen = []

    def export():
        for name, t in named:
            seen.append(name)
            yield name, t

    stream = check.checked(export())
    with pytest.raises(ConfigError, match="model.norm.weight_renamed"):
        for _ in stream:
            pass
    assert seen == [n for n, _ in named]  # nothing after the refused name was read
    with pytest.raises(ConfigError):
        check.checked(named)  # a list: before anything is sent
    assert check.checked(named[:-1]) == named[:-1]
    # a name on file with another shape: the engines would take it as silently
    wrong = [(n, t[:-1]) if n == "model.norm.weight" else (n, t) for n, t in named[:-1]]
    with pytest.raises(ConfigError, match=r"'model.norm.weight' of shape \(63,\), which the "
                                          r"checkpoint .* holds as \(64,\)"):
        NameCheck(model).checked(wrong)
    adapter = Adapter(config={}, tensors={"x.lora_A.weight": torch.zeros(1)})
    assert check.checked(adapter) is adapter  # its own route and names


def test_a_directory_without_weight_files_checks_nothing(tmp_path):
    NameCheck(tmp_path).check("anything.weight")
