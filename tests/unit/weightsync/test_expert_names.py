"""Fused MoE experts (transformers 5 keeps them as one [E, ...] tensor in memory) travel under
the checkpoint files' per-expert names, which SGLang's loader and megatron-bridge's export use:
the trainer sends views per expert, the hf engine receives into views of its fused tensors."""

import torch

from relax_slurm.modeling import checkpoint_views
from relax_slurm.tiny.model import build_model, build_tokenizer
from relax_slurm.trainer.model import full_named_weights
from relax_slurm.weightsync.receiver import load_named_tensors, model_checksums, tensor_sha256


def moe(seed: int):
    return build_model(build_tokenizer(), experts=4, experts_per_token=2, expert_size=8,
                       seed=seed)


def test_views_are_the_checkpoint_layout():
    fused = torch.arange(3 * 2 * 4 * 5, dtype=torch.float32).reshape(3, 8, 5)  # [E, 2I, H]
    views = dict(checkpoint_views("model.layers.1.mlp.experts.gate_up_proj", fused))
    assert sorted(views) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                   for e in range(3) for p in ("gate", "up"))
    assert torch.equal(views["model.layers.1.mlp.experts.2.gate_proj.weight"], fused[2, :4])
    assert torch.equal(views["model.layers.1.mlp.experts.2.up_proj.weight"], fused[2, 4:])
    assert all(v.is_contiguous() and v.untyped_storage().data_ptr()
               == fused.untyped_storage().data_ptr() for v in views.values())
    down = torch.zeros(3, 5, 4)
    assert [n for n, _ in checkpoint_views("m.experts.down_proj", down)] == [
        f"m.experts.{e}.down_proj.weight" for e in range(3)]
    dense = torch.zeros(4, 5)
    assert checkpoint_views("model.layers.0.mlp.gate_proj.weight", dense) == [
        ("model.layers.0.mlp.gate_proj.weight", dense)]


def test_trainer_names_load_into_a_fused_engine_model():
    trainer, engine = moe(seed=1), moe(seed=2)
    sent = list(full_named_weights(trainer))
    names = [n for n, _ in sent]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    load_named_tensors(engine, sent)
    for (name, a), b in zip(trainer.state_dict().items(), engine.state_dict().values()):
        assert torch.equal(a, b), name
    sums = model_checksums(engine)  # what weight_sync.verify compares, name by name
    assert all(sums[n] == tensor_sha256(t) for n, t in sent)
