"""trainer.recompute (issue #34: memory at long sequences): `full` under trainer=torch is
transformers' gradient checkpointing on the trained model (trainer/model.py recompute_layers):
each decoder layer's forward runs again in the backward, and the loss and every gradient are
those of the run that kept its activations, bit for bit (the same ops on the same inputs;
dropout is 0). The config refuses what a backend cannot do, naming the field."""

from __future__ import annotations

import pytest
import torch

from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.model import load_hf_model
from tests.helpers_tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("recompute") / "model")


def loss_grads_and_layer_calls(tiny, recompute: str):
    model = load_hf_model(ModelConfig(path=str(tiny)), torch.device("cpu"), trained=True,
                          recompute=recompute).train()
    calls = []
    # a pre-hook: torch's non-reentrant checkpoint stops the recompute once the last saved
    # tensor is made again, so the layer's last module may not reach its post-hooks
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(3, 16, (4, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    forward_calls = len(calls)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, forward_calls, len(calls)


def test_full_recompute_runs_each_layer_again_and_changes_no_gradient(tiny):
    loss, grads, fwd, total = loss_grads_and_layer_calls(tiny, "none")
    loss_r, grads_r, fwd_r, total_r = loss_grads_and_layer_calls(tiny, "full")
    assert (fwd, total) == (1, 1)  # activations kept: the attention runs once
    assert (fwd_r, total_r) == (1, 2)  # and again in the backward
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys()
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads), [
        n for n in grads if not torch.equal(grads[n], grads_r[n])]


def test_the_config_names_what_a_backend_cannot_recompute():
    with pytest.raises(ConfigError, match=r"trainer.recompute='layers'.*none, full, selective"):
        TrainerConfig(recompute="layers")
    with pytest.raises(ConfigError, match=r"trainer.recompute=selective.*trainer=megatron"):
        TrainerConfig(recompute="selective")
    assert TrainerConfig(backend="megatron", recompute="selective").recompute == "selective"


def test_megatron_gets_megatron_cores_recompute_fields():
    from types import SimpleNamespace

    from relax_slurm.trainer.megatron.model import set_recompute

    full, selective, none = SimpleNamespace(), SimpleNamespace(), SimpleNamespace()
    set_recompute(full, "full")
    set_recompute(selective, "selective")
    set_recompute(none, "none")
    assert vars(full) == {"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1}
    assert vars(selective) == {"recompute_granularity": "selective"}
    assert vars(none) == {}
