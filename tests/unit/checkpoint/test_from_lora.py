"""relax-convert of a model.lora checkpoint (checkpoint/from_lora.py, convert.py convert_lora):
a trainer=megatron one goes through the same PEFT writer and merge as a trainer=torch one, with
its adapter read by the megatron backend (here a stand-in returning what that reader returns:
{PEFT saved name: full tensor}; the real reader on a real run's checkpoint is
tests/integration/test_megatron_lora.py). A base model that is gone is named with the file
that records it, before the checkpoint is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relax_slurm.checkpoint import CheckpointError, convert_checkpoint
from relax_slurm.checkpoint import convert as convert_module
from relax_slurm.config.model import DEFAULT_LORA_TARGETS, LoraConfig, ModelConfig

IDS = torch.tensor([[3, 4, 13, 5, 14, 9], [6, 7, 13, 8, 14, 2]])


@pytest.fixture(scope="module")
def policy(tiny_dir):
    """trainer=torch's LoRA policy on the tiny model (its lm_head tied, adapted too, as the
    tiny_cpu preset does), every A and B nonzero: a trained adapter."""
    from relax_slurm.trainer.lora import apply_lora

    cfg = ModelConfig(path=str(tiny_dir), lora=LoraConfig(
        rank=4, alpha=8.0, target_modules=DEFAULT_LORA_TARGETS + ["lm_head"]))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), cfg)
    assert model.config.tie_word_embeddings
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def megatron_lora_checkpoint(root: Path, policy, base_path: str) -> Path:
    """What detect_format and convert_lora read of a trainer=megatron model.lora step_<N>/:
    Megatron's metadata.json and meta.json with the adapter's record (its tensors come from the
    stand-in reader)."""
    from relax_slurm.trainer.lora import checkpoint_record

    step = root / "step_4"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (step / "meta.json").write_text(json.dumps({
        "format": "relax-slurm-dcp", "format_version": 1, "step": 4, "backend": "megatron",
        "extra_state": {"lora": checkpoint_record(policy, base_path)}}))
    return step


def torch_lora_checkpoint(root: Path, policy, base_path: str) -> Path:
    """A trainer=torch model.lora checkpoint of the policy: DCP of its trainable parameters
    (the adapter) and optimizer, as TorchBackend.save writes it."""
    from relax_slurm.checkpoint import save_checkpoint
    from relax_slurm.trainer.lora import CHECKPOINT_KEY, checkpoint_record

    trainable = [p for p in policy.parameters() if p.requires_grad]
    save_checkpoint(root / "checkpoints", 4, policy, torch.optim.AdamW(trainable), None,
                    {CHECKPOINT_KEY: checkpoint_record(policy, base_path)}, keep_last=1,
                    trainable_only=True)
    return root / "checkpoints" / "step_4"


CHECKPOINT_OF = {"megatron": megatron_lora_checkpoint, "torch": torch_lora_checkpoint}


@pytest.fixture
def read_adapter_of(policy, monkeypatch):
    """The megatron backend's reader replaced by the policy's adapter under PEFT's saved names
    (what AutoBridge.export_adapter_weights gives); records each call."""
    from relax_slurm.trainer.lora import adapter_of

    calls: list[Path] = []

    def reader(src: Path, hf_config) -> dict[str, torch.Tensor]:
        calls.append(src)
        return adapter_of(policy).tensors

    monkeypatch.setattr(convert_module, "megatron_adapter", reader)
    return calls


@pytest.mark.parametrize("trainer", ["megatron", "torch"])
def test_a_lora_checkpoint_of_either_trainer_converts_to_peft_and_to_merged_hf(
        trainer, policy, tiny_dir, tmp_path, read_adapter_of):
    """The old code refused trainer=megatron's (`cannot read yet`); both now go through the
    same two writers. In one process the same PEFT code runs on the same float32 tensors on
    both sides of each comparison, so nothing can differ: equality is exact."""
    from peft import PeftModel, get_peft_model_state_dict

    from relax_slurm.trainer.lora import adapter_of, merged_parameters

    step = CHECKPOINT_OF[trainer](tmp_path / "run", policy, str(tiny_dir))
    adapter = adapter_of(policy).tensors
    peft_dir = convert_checkpoint(step, tmp_path / "peft", to="peft")
    written = load_file(str(peft_dir / "adapter_model.safetensors"))
    assert sorted(written) == sorted(adapter)
    assert all(torch.equal(written[n], t) for n, t in adapter.items())
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_dir) and config["r"] == 4
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), peft_dir).eval()
    held = get_peft_model_state_dict(loaded, save_embedding_layers=False)
    assert sorted(held) == sorted(written)  # nothing missing, nothing unexpected
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, policy(input_ids=IDS).logits)

    merged = dict(AutoModelForCausalLM.from_pretrained(
        convert_checkpoint(step, tmp_path / "hf", to="hf"), dtype=torch.float32
    ).named_parameters())
    # trainer=torch's merged weights (W + s B A, computed aside); the tied head, which that
    # dedups into the embeddings, merged into a head of its own, the embeddings left as they are
    want = dict(merged_parameters(policy))
    embeddings = want["model.embed_tokens.weight"]
    with torch.no_grad():
        want["lm_head.weight"] = embeddings + policy.get_base_model().lm_head.get_delta_weight(
            "default")
    assert sorted(merged) == sorted(want)
    assert all(torch.equal(merged[n], w) for n, w in want.items())
    assert not torch.equal(merged["lm_head.weight"], embeddings)
    assert read_adapter_of == ([step, step] if trainer == "megatron" else [])


def test_a_base_model_that_is_gone_is_named_with_its_record_and_the_fix(
        policy, tiny_dir, tmp_path, read_adapter_of):
    gone = tmp_path / "moved_away" / "model"
    step = megatron_lora_checkpoint(tmp_path / "run", policy, str(gone))
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(step, tmp_path / "hf", to="hf")
    assert str(step / "meta.json") in str(e.value) and str(gone) in str(e.value)
    assert "Fix: --hf-config" in str(e.value) and "--to peft" in str(e.value)
    assert read_adapter_of == [] and not (tmp_path / "hf").exists()  # refused before reading
    with pytest.raises(CheckpointError, match="--hf-config .*nowhere is not a Hugging Face"):
        convert_checkpoint(step, tmp_path / "hf", to="hf", hf_config=tmp_path / "nowhere")
    # the adapter alone needs no base; a copy of the base given by --hf-config merges
    assert (convert_checkpoint(step, tmp_path / "peft", to="peft")
            / "adapter_model.safetensors").is_file()
    assert (convert_checkpoint(step, tmp_path / "hf", to="hf", hf_config=tiny_dir)
            / "model.safetensors").is_file()


def test_a_lora_checkpoint_converts_to_peft_or_hf_only(policy, tiny_dir, tmp_path,
                                                      read_adapter_of):
    step = megatron_lora_checkpoint(tmp_path / "run", policy, str(tiny_dir))
    with pytest.raises(CheckpointError, match="model.lora checkpoint.*Fix: --to peft or --to hf"):
        convert_checkpoint(step, tmp_path / "dcp", to="dcp")
    assert read_adapter_of == []
