"""model.lora's cross-section checks name the override that fixes them, and the launch lines
of the policy's engines carry the adapter flags only when each sync sends the adapter."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_slurm.config import register_configs, to_train_config
from relax_slurm.errors import ConfigError
from relax_slurm.launch.roles import engine_spec

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs()


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_train_config(compose("train", overrides=[
            "run_dir=/tmp/relax-test-run", "experiment=tiny_cpu", "model.lora.rank=8", *overrides]))


def test_tiny_cpu_sets_loras_lr_and_lm_head_and_full_fine_tuning_ignores_them():
    # rank 0 is tiny_cpu's full fine-tuning unchanged: trainer.lr, no adapter syncs
    full = config("model.lora.rank=0")
    assert full.model.lora.policy_lr(full.trainer.lr) == full.trainer.lr == 2e-3
    assert not full.adapter_sync
    lora = config()
    assert lora.model.lora.policy_lr(lora.trainer.lr) == 3e-3 and lora.trainer.lr == 2e-3
    assert "lm_head" in lora.model.lora.target_modules and lora.adapter_sync
    unset = config("model.lora.lr=null")
    assert unset.model.lora.policy_lr(unset.trainer.lr) == 2e-3


@pytest.mark.parametrize("overrides, words", [
    (["model.lora.lr=0"], "model.lora.lr=0"),
    (["trainer=megatron", "trainer.context_parallel_size=2"],
     "model.lora with trainer=megatron and trainer.context_parallel_size=2"),
    (["algo.kl_coef=0.01", "algo.ref_update_interval=5"], "algo.ref_update_interval=5"),
    (["trainer.freeze_modules=[model.embed_tokens]"], "trainer.freeze_modules"),
    (["weight_sync.verify=true"], "weight_sync.verify=false"),
    (["rollout=sglang", "model.lora.sync=adapter",
      "model.lora.target_modules=[q_proj,c_attn]"], "model.lora.sync=auto"),
])
def test_what_lora_does_not_combine_with_is_refused_naming_the_fix(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(".", r"\.")):
        config(*overrides)


def test_an_async_run_on_sglang_syncs_the_adapter_alone():
    # versioned adapter names (engines/served_adapter.py): it used to be refused
    assert config("rollout=sglang", "algo.max_staleness=1").adapter_sync


def test_the_adapter_flags_go_to_the_policys_engines_only_when_syncs_send_it():
    cfg = config("rollout=sglang", "rollout.engine_device=cpu")
    assert cfg.adapter_sync
    argv = engine_spec(cfg, "engine0", "http://127.0.0.1:1", cfg.model.path, 0).argv
    line = " ".join(argv)
    assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj" in line
    assert "--lora-backend torch_native" in line
    teacher = engine_spec(cfg, "teacher", "http://127.0.0.1:2", "/other/model", 0).argv
    assert "--enable-lora" not in teacher
    merged = config("model.lora.sync=merged")
    assert not merged.adapter_sync
    assert "--enable-lora" not in engine_spec(merged, "engine0", "http://127.0.0.1:1",
                                              merged.model.path, 0).argv
    hf = config()
    assert "--enable-lora" in engine_spec(hf, "engine0", "http://127.0.0.1:1",
                                          hf.model.path, 0).argv
    assert not config("model.lora.rank=0").adapter_sync  # LoRA off: full syncs
