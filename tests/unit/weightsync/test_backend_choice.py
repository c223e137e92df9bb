"""Which backend the weight-sync group uses: NCCL only where every rank holds CUDA tensors.

The first GPU run (one H200, the trainer on cuda:0, the hf engine on the CPU) took `auto` for
NCCL because the trainer saw a GPU; the engine's receive into CPU tensors failed at once. The
decision is a pure function of what the trainer sees (CUDA or not) and where the engines keep
their weights (SGLang on GPUs, the hf engine on the CPU); `torch.cuda.is_available` is set here
to the GPU machine's answer, since this machine has no GPU to ask."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from relax_slurm.config import register_configs, to_train_config
from relax_slurm.errors import ConfigError, WeightSyncError
from relax_slurm.launch.compose import CONF_DIR
from relax_slurm.weightsync import resolve_backend

register_configs()


@pytest.mark.parametrize("cuda, engines_on_gpu, expected", [
    (True, True, "nccl"), (True, False, "gloo"), (False, True, "gloo"), (False, False, "gloo")])
def test_auto_is_nccl_only_with_a_gpu_on_both_sides(monkeypatch, cuda, engines_on_gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_backend("auto", engines_on_gpu=engines_on_gpu) == expected


def test_nccl_without_a_gpu_names_the_fix():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(WeightSyncError, match="weight_sync.backend=gloo"):
        resolve_backend("nccl")


def test_nccl_with_the_hf_engine_is_refused_naming_the_key():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=tiny_cpu", "run_dir=/tmp/r",
                                          "weight_sync.backend=nccl"])
    with pytest.raises(ConfigError, match=r"weight_sync\.backend=nccl with rollout\.engine=hf"):
        to_train_config(cfg)
