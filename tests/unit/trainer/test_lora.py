"""model.lora in the torch backend (trainer/lora.py): the reference is model.path exactly, the
merged weights are PEFT's merge, the adapter crosses the wire intact, the config refuses what
LoRA does not combine with."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from helpers_tiny import make_tiny_model  # noqa: E402
from relax_slurm.config.model import LoraConfig, ModelConfig  # noqa: E402
from relax_slurm.errors import ConfigError  # noqa: E402
from relax_slurm.trainer.lora import (AdapterDisabled, adapter_of, apply_lora,  # noqa: E402
                                      merged_parameters)
from relax_slurm.weightsync.adapter import read_tensors, serialize_tensors  # noqa: E402

IDS = torch.tensor([[3, 4, 13, 5, 14], [6, 6, 13, 7, 14]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_lora"))


def policy(tiny: Path, seed: int = 0):
    """A PEFT policy whose adapter is not zero (as after training steps)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    torch.manual_seed(seed)  # PEFT draws A at random
    model = apply_lora(base, ModelConfig(path=str(tiny), lora=LoraConfig(rank=4)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@torch.no_grad()
def test_the_reference_is_model_path_itself_with_no_second_copy(tiny):
    from transformers import AutoModelForCausalLM

    model = policy(tiny)
    ref = AdapterDisabled(model)
    fresh = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    # the same modules compute both: bit for bit, not within a tolerance
    assert torch.equal(ref(input_ids=IDS).logits, fresh(input_ids=IDS).logits)
    assert not torch.equal(model(input_ids=IDS).logits, fresh(input_ids=IDS).logits)
    only = [n for n, p in model.named_parameters() if p.requires_grad]
    assert only and all(".lora_" in n for n in only)


@torch.no_grad()
def test_merged_weights_are_peft_merge_under_the_base_model_names(tiny):
    model = policy(tiny)
    merged = dict(merged_parameters(model))
    reference = policy(tiny).merge_and_unload()  # same seed: the same adapter
    expected = dict(reference.named_parameters())
    assert merged.keys() == expected.keys()
    for name, t in expected.items():
        # W + s * B @ A in either order of the same float32 ops
        torch.testing.assert_close(merged[name], t, rtol=0, atol=1e-6)
    # the live model's own weights are untouched (no merge and unmerge)
    assert any(".base_layer." in n for n, _ in model.named_parameters())


def test_the_adapter_crosses_the_wire_bit_for_bit(tiny):
    adapter = adapter_of(policy(tiny))
    assert adapter.config["r"] == 4 and adapter.config["peft_type"] == "LORA"
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter.tensors)
    back = read_tensors(serialize_tensors(adapter.tensors))
    assert back.keys() == adapter.tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in adapter.tensors.items())
    assert adapter.nbytes == sum(t.numel() * 4 for t in adapter.tensors.values())


def test_a_pickle_that_calls_anything_else_is_refused():
    import base64
    import os
    import pickle

    from relax_slurm.errors import WeightSyncError

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(WeightSyncError, match="not allowed"):
        read_tensors(base64.b64encode(pickle.dumps({"x": Evil()})).decode())


@pytest.mark.parametrize("override, words", [
    ({"rank": -1}, "model.lora.rank=-1"),
    ({"rank": 8, "alpha": 0}, "model.lora.alpha=0"),
    ({"rank": 8, "dropout": 1.0}, "model.lora.dropout=1.0"),
    ({"rank": 8, "target_modules": []}, "model.lora.target_modules is empty"),
    ({"rank": 8, "sync": "full"}, "model.lora.sync='full'"),
])
def test_bad_lora_fields_name_the_field(override, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(".", r"\.")):
        LoraConfig(**override)


def test_a_trainer_without_lora_never_imports_peft():
    """peft costs ~2.5 CPU-s to import (transformers' model machinery): a trainer rank of
    either backend pays it only when model.lora makes or reads an adapter."""
    import subprocess

    code = ("import sys, relax_slurm.trainer.main, relax_slurm.trainer.megatron.backend, "
            "relax_slurm.trainer.lora; print(sorted(m for m in sys.modules if m == 'peft'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
