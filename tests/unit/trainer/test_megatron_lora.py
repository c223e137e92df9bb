"""model.lora under trainer=megatron, its pure parts (relax_slurm/trainer/megatron/lora.py): PEFT's
targets to megatron-bridge's CanonicalLoRA, the TP shard of a full adapter tensor, the q/k/v
interleave per TP rank, and the adapter config a sync sends (trainer=torch's). The model-level
parity at TP=2 is tests/integration/test_megatron_lora.py."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from helpers_tiny import make_tiny_model  # noqa: E402
from relax_slurm.config.model import DEFAULT_LORA_TARGETS, LoraConfig, ModelConfig  # noqa: E402
from relax_slurm.errors import ConfigError  # noqa: E402
from relax_slurm.trainer.megatron import lora  # noqa: E402


def test_every_peft_target_maps_to_a_canonical_one():
    assert lora.canonical_targets(DEFAULT_LORA_TARGETS + ["lm_head"]) == [
        "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
        "linear_fc2", "output_layer"]
    # a part of a fused layer alone: CanonicalLoRA adapts q (or up) by itself, exactly
    assert lora.canonical_targets(["q_proj"]) == ["linear_q"]
    assert lora.canonical_targets(["up_proj", "v_proj"]) == ["linear_fc1_up", "linear_v"]


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["qkv_proj"], ["mlp"]])
def test_targets_megatron_cannot_adapt_are_refused(targets):
    with pytest.raises(ConfigError, match="model.lora.target_modules") as e:
        lora.canonical_targets(targets)
    assert "trainer=torch" in str(e.value)


def test_expert_targets_on_an_moe_model_are_refused_before_anything_is_built():
    """apply_lora reads the built model's expert count (any EP): the MLP targets of an MoE
    model are its routed experts, which megatron-bridge and PEFT adapt differently."""
    from types import SimpleNamespace

    moe = [SimpleNamespace(config=SimpleNamespace(num_moe_experts=16))]
    cfg = ModelConfig(path="unused", lora=LoraConfig(rank=8))  # the default targets: the MLP
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules has \['gate_proj', "
                       r"'up_proj', 'down_proj'\], which on this MoE model \(16 experts") as e:
        lora.apply_lora(moe, cfg)
    assert "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]" in str(e.value)
    lora.check_no_expert_targets(["q_proj", "o_proj", "lm_head"], "an MoE model")


def test_rank_must_split_over_tp():
    lora.check_rank_split(8, 2)
    with pytest.raises(ConfigError, match="model.lora.rank=6 .*tensor_parallel_size=4"):
        lora.check_rank_split(6, 4)


def _param(shape, dim=None):
    p = torch.nn.Parameter(torch.zeros(shape))
    if dim is not None:
        p.tensor_model_parallel, p.partition_dim = True, dim
    return p


def test_local_shard_splits_along_the_partition_dim():
    full = torch.arange(48.0).view(8, 6)
    assert torch.equal(lora.local_shard(full, _param((4, 6), 0), 1, 2), full[4:])
    assert torch.equal(lora.local_shard(full, _param((8, 3), 1), 0, 2), full[:, :3])
    assert lora.local_shard(full, _param((8, 6)), 1, 2) is full  # replicated
    assert lora.local_shard(full, _param((8, 6), 0), 0, 1) is full  # TP=1


@pytest.mark.parametrize("heads,groups", [(4, 2), (2, 1), (4, 4), (1, 1)])
def test_interleave_is_megatrons_fused_qkv_order(heads, groups):
    """Megatron's linear_qkv output, per token: for each query group its heads/groups query
    heads, then its key head, then its value head; on any number of tokens (odd too)."""
    d, tokens = 3, 5
    q = torch.randn(tokens, 1, heads * d)
    k = torch.randn(tokens, 1, groups * d)
    v = torch.randn(tokens, 1, groups * d)
    out = lora.interleave_local_qkv(q, k, v, heads, groups, d)
    per = heads // groups
    expected = torch.cat([torch.cat([q[..., (g * per + h) * d:(g * per + h + 1) * d]
                                     for h in range(per)]
                                    + [k[..., g * d:(g + 1) * d], v[..., g * d:(g + 1) * d]], -1)
                          for g in range(groups)], -1)
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("megatron_lora") / "tiny")


def test_adapter_config_is_trainer_torch_peft_config(tiny):
    """What an adapter-only sync (and relax-convert --to peft) carries as adapter_config.json:
    the same as trainer=torch's PEFT model records for the same model.lora."""
    from transformers import AutoModelForCausalLM

    from relax_slurm.trainer.lora import adapter_config, apply_lora

    cfg = ModelConfig(path=str(tiny), lora=LoraConfig(rank=8, alpha=16.0, dropout=0.0))
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), cfg)
    assert lora.adapter_config(cfg) == adapter_config(peft_model)


def test_a_tied_lm_head_adapter_is_refused_where_weights_are_merged():
    from types import SimpleNamespace

    def hf_config(tied):
        text = SimpleNamespace(tie_word_embeddings=tied)
        return SimpleNamespace(tie_word_embeddings=tied, get_text_config=lambda: text)

    cfg = ModelConfig(path="/m", lora=LoraConfig(rank=8, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="save_hf_every=5 writes merged.*Fix: drop lm_head"):
        lora.check_mergeable(hf_config(True), cfg, "trainer.save_hf_every=5 writes merged")
    lora.check_mergeable(hf_config(False), cfg, "-")  # its own lm_head: merged as any linear
    lora.check_mergeable(hf_config(True), ModelConfig(path="/m", lora=LoraConfig(rank=8)), "-")


def test_both_trainers_refuse_merging_a_tied_head_by_one_rule(tiny):
    """One function for trainer=torch and trainer=megatron (it was two, each reading the
    config its own way), given a transformers config: the tiny model ties its head."""
    from transformers import AutoConfig

    from relax_slurm.trainer import lora as torch_lora

    assert lora.check_mergeable is torch_lora.check_mergeable
    config = AutoConfig.from_pretrained(tiny)
    cfg = ModelConfig(path="/m", lora=LoraConfig(rank=8, target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match="this run syncs merged weights"):
        torch_lora.check_mergeable(config, cfg, "this run syncs merged weights")


def test_the_recorded_lora_is_the_runs():
    """relax-convert rebuilds the adapters from the checkpoint's record (meta.json
    extra_state.lora) to read them back: the same model.lora the run trained."""
    cfg = ModelConfig(path="/m", lora=LoraConfig(rank=8, alpha=32.0, dropout=0.1,
                                                 target_modules=["v_proj", "lm_head"]))
    again = lora.recorded_model_config(lora.checkpoint_record(cfg), "/ckpt/hf")
    assert again.path == "/ckpt/hf"
    assert (again.lora.rank, again.lora.alpha, again.lora.dropout) == (8, 32.0, 0.1)
    assert sorted(again.lora.target_modules) == ["lm_head", "v_proj"]
    assert lora.canonical_targets(again.lora.target_modules)  # megatron can build them


# ---- config: what trainer=megatron's LoRA refuses (config/cross_checks.py check_lora) -------

CONF = Path(__file__).resolve().parents[3] / "conf"


def megatron_config(*overrides: str):
    from hydra import compose, initialize_config_dir

    from relax_slurm.config import register_configs, to_train_config

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_train_config(compose("train", overrides=[
            "run_dir=/tmp/relax-test-run", "experiment=tiny_cpu", "model.lora.rank=8",
            "trainer=megatron", *overrides]))


def test_megatron_lora_at_tp_and_dp_is_accepted_with_every_target_it_maps():
    cfg = megatron_config("trainer.tensor_parallel_size=2")
    assert cfg.trainer.backend == "megatron" and cfg.adapter_sync
    assert set(cfg.model.lora.target_modules) == set(lora.HF_TO_CANONICAL)
    megatron_config()  # TP=1, two data-parallel ranks


def test_megatron_lora_at_ep_pp_with_the_distributed_optimizer_and_ppo_is_accepted():
    cfg = megatron_config("trainer.expert_parallel_size=2",
                          "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,lm_head]")
    assert cfg.trainer.expert_parallel_size == 2
    assert megatron_config("trainer.use_distributed_optimizer=true",
                           "trainer.tensor_parallel_size=2").trainer.use_distributed_optimizer
    assert megatron_config("algo=ppo").algo.uses_critic  # the critic: full weights, its own
    # pipeline parallelism (test_megatron_lora.py's pp2 parity row)
    assert megatron_config("trainer.pipeline_parallel_size=2").trainer.pipeline_parallel_size == 2


@pytest.mark.parametrize("overrides, words", [
    (["trainer.context_parallel_size=2"],
     "model.lora with trainer=megatron and trainer.context_parallel_size=2"),
    # the preset's targets include the MLP, which at EP > 1 are the routed experts
    (["trainer.expert_parallel_size=2"],
     "model.lora.target_modules has ['gate_proj', 'up_proj', 'down_proj'], which with "
     "trainer.expert_parallel_size=2"),
    (["trainer.expert_parallel_size=2", "model.lora.target_modules=[q_proj,down_proj]"],
     "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"),
    (["model.lora.target_modules=[q_proj,embed_tokens]"], "['embed_tokens']"),
    (["trainer.tensor_parallel_size=2", "model.lora.rank=5"], "model.lora.rank=5"),
])
def test_what_megatron_lora_does_not_do_yet_is_refused_naming_the_field(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(".", r"\.")):
        megatron_config(*overrides)
