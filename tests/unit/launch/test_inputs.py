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


def test_a_qwen3_vl_moe_sglang_cannot_load_as_transformers_does_is_refused(tmp_path):
    """SGLang's Qwen3-VL-MoE reads the fused experts in Qwen's released layout and adds vision
    features to exactly 3 decoder layers (docs/engines.md#sglang-on-cpu): a file in
    transformers 5's layout (what its save_pretrained writes for a model it built) and another
    DeepStack count are refused with rollout=sglang, naming the field; the hf engine takes
    both."""
    import json

    import torch
    from safetensors.torch import save_file

    model = tmp_path / "model"
    cfg, on_hf = cfg_for(tmp_path, "rollout=sglang"), cfg_for(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    E, H, I = 4, 64, 16
    name = "model.language_model.layers.0.mlp.experts."

    def write(gate_up: tuple, down: tuple, deepstack: int) -> None:
        (model / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "text_config": {"hidden_size": H, "moe_intermediate_size": I},
            "vision_config": {"deepstack_visual_indexes": list(range(deepstack))}}))
        save_file({name + "gate_up_proj": torch.zeros(gate_up),
                   name + "down_proj": torch.zeros(down)}, str(model / "model.safetensors"))

    write((E, H, 2 * I), (E, I, H), 3)  # Qwen's layout, Qwen's DeepStack
    check_inputs(cfg)
    write((E, 2 * I, H), (E, H, I), 3)
    with pytest.raises(ConfigError, match=r"model\.path=.*: model\.language_model\.layers\.0\.mlp"
                                          r"\.experts\.down_proj is in transformers 5's "
                                          r"layout.*Fix: save the two fused tensors"):
        check_inputs(cfg)
    check_inputs(on_hf)
    write((E, H, 2 * I), (E, I, H), 1)
    with pytest.raises(ConfigError, match=r"model\.path=.*: a Qwen3VLMoeForConditionalGeneration "
                                          r"with 1 DeepStack layers .*exactly 3 decoder layers"):
        check_inputs(cfg)
    check_inputs(on_hf)


def test_a_qwen3_vl_whose_interleaved_mrope_sglang_would_not_read_is_refused(tmp_path):
    """transformers always interleaves Qwen3-VL's and Qwen3-Omni's M-RoPE sections; SGLang only
    when the text rope settings say mrope_interleaved (else image prompts' log-probs differ):
    refused with rollout=sglang without it, for a Qwen3-Omni's thinker too (trained under
    trainer=megatron)."""
    import json

    cfg, on_hf = (cfg_for(tmp_path, "rollout=sglang", "trainer=megatron"),
                  cfg_for(tmp_path, "trainer=megatron"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True}
    config = tmp_path / "model" / "config.json"
    for arch, nest in (("Qwen3VLForConditionalGeneration", lambda c: c),
                       ("Qwen3OmniMoeForConditionalGeneration",
                        lambda c: {"thinker_config": c})):
        for key in ("rope_scaling", "rope_parameters"):
            body = {"text_config": {key: rope},
                    "vision_config": {"deepstack_visual_indexes": [0, 1, 2]}}
            config.write_text(json.dumps({"architectures": [arch], **nest(body)}))
            with pytest.raises(ConfigError, match=r"no \"mrope_interleaved\": true.*Fix: add"):
                check_inputs(cfg)
            check_inputs(on_hf)
            body["text_config"][key] = dict(rope, mrope_interleaved=True)
            config.write_text(json.dumps({"architectures": [arch], **nest(body)}))
            check_inputs(cfg)


def test_an_omni_model_under_trainer_torch_is_refused_naming_megatron(tmp_path):
    """Qwen2.5-Omni's and Qwen3-Omni's whole model has no forward (the thinker's trains): under
    trainer=torch the first step failed with `_forward_unimplemented() got an unexpected
    keyword argument 'input_ids'` after every role had started."""
    import json

    config = tmp_path / "model" / "config.json"
    torch_cfg, megatron_cfg = cfg_for(tmp_path), cfg_for(tmp_path, "trainer=megatron")
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    config.write_text(json.dumps({"model_type": "qwen2_5_omni", "thinker_config": {}}))
    with pytest.raises(ConfigError, match=r"model\.path=.*model: an Omni model .* trains under "
                                          r"trainer=megatron only.*Fix: trainer=megatron"):
        check_inputs(torch_cfg)
    check_inputs(megatron_cfg)
    config.write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    check_inputs(torch_cfg)


def test_a_model_sglang_has_no_class_for_is_refused_on_sglang(tmp_path):
    """SGLang 0.5.21-0.5.23 serve no Qwen2.5-Omni (test_sglang_source.py reads their model
    files): refused before anything starts with rollout=sglang, naming rollout.engine=hf,
    which serves its thinker."""
    import json

    on_sglang = cfg_for(tmp_path, "rollout=sglang", "trainer=megatron")
    on_hf = cfg_for(tmp_path, "trainer=megatron")
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2_5OmniForConditionalGeneration"], "thinker_config": {}}))
    with pytest.raises(ConfigError, match=r"model\.path=.*a Qwen2_5OmniForConditionalGeneration, "
                                          r"which SGLang 0.5.21, 0.5.22, 0.5.23 has no model "
                                          r"for.*rollout.engine=hf"):
        check_inputs(on_sglang)
    check_inputs(on_hf)


def test_lora_on_a_multimodal_model_under_megatron_is_refused_with_the_fix_that_applies(
        tmp_path):
    """Refused before anything starts (the megatron backend refused it only once its model was
    built); an Omni model has no trainer=torch to fall back on, so its fix is the rank."""
    import json

    config = tmp_path / "model" / "config.json"
    lora = cfg_for(tmp_path, "trainer=megatron", "model.lora.rank=8")
    (tmp_path / "d.jsonl").write_text('{"prompt": "3+3=", "label": "6"}\n')
    for body, fix in (({"model_type": "qwen2_5_vl", "vision_config": {}},
                       "trainer=torch, or model.lora.rank=0"),
                      ({"model_type": "qwen3_omni_moe", "thinker_config": {}},
                       "model.lora.rank=0")):
        config.write_text(json.dumps(body))
        with pytest.raises(ConfigError, match=r"model.lora with trainer=megatron and a "
                                              r"multimodal model .* Fix: " + fix + "$"):
            check_inputs(lora)
    config.write_text(json.dumps({"model_type": "qwen3"}))
    check_inputs(lora)
