"""trainer=megatron with vision-language models: what the config allows and refuses, and
`trainer.freeze_modules` in HF names mapped onto the megatron model's parameters
(relax_slurm/trainer/megatron/vl.py). The models themselves:
tests/integration/test_megatron_vl.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2AudioConfig, Qwen3VLMoeConfig

from relax_slurm.errors import ConfigError
from relax_slurm.launch.submit import compose_config
from relax_slurm.trainer.megatron import vl
from relax_slurm.trainer.megatron.model import freeze


def compose(*overrides: str):
    return compose_config(["experiment=tiny_vl_cpu", "run_dir=/tmp/x", "trainer=megatron",
                           *overrides])


def test_images_with_tensor_parallelism_compose():
    cfg = compose("trainer.tensor_parallel_size=2", "trainer.nproc_per_node=2",
                  "trainer.freeze_modules=[model.visual]")
    assert cfg.trainer.backend == "megatron" and dict(cfg.data.multimodal_keys)


@pytest.mark.parametrize("overrides, words", [
    (("+data.multimodal_keys.video=videos",), "images only"),
    (("trainer.pipeline_parallel_size=2", "trainer.nproc_per_node=2"), "tensor parallelism only"),
])
def test_refused_with_the_fix(overrides, words):
    with pytest.raises(Exception) as e:
        compose(*overrides)
    assert words in str(e.value) and "docs/backends.md#multimodal-models" in str(e.value)


def test_unsupported_architectures_name_the_reason():
    with pytest.raises(ConfigError, match="no Qwen2-Audio bridge"):
        vl.kind(Qwen2AudioConfig())
    with pytest.raises(ConfigError, match="Qwen3-VL-MoE needs GPUs"):  # this machine: no CUDA
        vl.kind(Qwen3VLMoeConfig())


def test_freeze_modules_maps_hf_prefixes():
    chunk = torch.nn.Module()
    chunk.visual = torch.nn.Linear(2, 2)
    chunk.language_model = torch.nn.Linear(2, 2)
    prefixes = ["model.visual"]
    freeze([chunk], [vl.hf_prefix_to_megatron(vl.QWEN25, p) for p in prefixes], prefixes)
    assert not chunk.visual.weight.requires_grad and chunk.language_model.weight.requires_grad
    assert vl.hf_prefix_to_megatron(vl.QWEN3, "model.visual.blocks") == "vision_model.blocks"
    with pytest.raises(ConfigError, match="'model.vision' matches no parameter"):
        freeze([chunk], ["model.vision"], ["model.vision"])
