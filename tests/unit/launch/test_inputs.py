"""What the launcher checks before anything starts (launch/inputs.py)."""

from pathlib import Path

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.launch.compose import compose_config
from relax_slurm.launch.inputs import check_inputs


def cfg_for(tmp_path: Path, *overrides: str):
    """tiny_cpu on a model directory and a data file that exist (their contents are read only
    after the reward's check)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text("")
    return compose_config(["experiment=tiny_cpu", f"run_dir={tmp_path / 'run'}",
                           f"model.path={tmp_path / 'model'}",
                           f"data.train_files=[{tmp_path / 'd.jsonl'}]", *overrides])


def test_a_reward_that_waits_on_a_service_scored_inline_is_refused_before_the_start(tmp_path):
    """Its trait is declared where the reward is registered (service=True); the config alone
    does not import the rewards, the launcher does."""
    cfg = cfg_for(tmp_path, "reward.name=remote", "reward.remote_url=http://127.0.0.1:9",
                  "reward.num_workers=0")
    with pytest.raises(ConfigError, match=r"reward\.num_workers=0 with reward\.name=remote: "
                                          "it waits on a service"):
        check_inputs(cfg)
    assert cfg.reward.num_workers == 0 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_a_tied_moe_is_refused_on_sglang_which_never_ties_its_head(tmp_path, architecture):
    """SGLang's Qwen2/3-MoE builds its own output head whatever tie_word_embeddings says: the
    tied checkpoint's head would stay empty (docs/engines.md#sglang-on-cpu). The hf engine ties
    it; an untied MoE and a tied dense Qwen3 are served whole by SGLang."""
    import json

    config = tmp_path / "model" / "config.json"
    cfg, on_hf = cfg_for(tmp_path, "rollout=sglang"), cfg_for(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    for arch, tied in ((architecture, False), ("Qwen3ForCausalLM", True)):
        config.write_text(json.dumps({"architectures": [arch], "tie_word_embeddings": tied}))
        check_inputs(cfg)
    config.write_text(json.dumps({"architectures": [architecture], "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match=rf"model\.path=.*model: a {architecture} with "
                                          r"tie_word_embeddings=true, whose output head SGLang "
                                          r"never ties.*Save the model untied"):
        check_inputs(cfg)
    check_inputs(on_hf)  # rollout.engine=hf
