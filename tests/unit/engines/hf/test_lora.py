"""The hf engine serves LoRA adapters as SGLang does (--enable-lora, /load_lora_adapter_from_
tensors, /unload_lora_adapter, /update_weight_version, /generate's lora_path), and its log-probs
with the adapter are the trainer's PEFT model's."""

import httpx
import pytest
import torch

from helpers_tiny import running_engine
from relax_slurm.config.model import LoraConfig, ModelConfig
from relax_slurm.engines import sglang_api
from relax_slurm.engines.client import EngineClient
from relax_slurm.errors import EngineError
from relax_slurm.trainer.lora import adapter_of, apply_lora
from relax_slurm.weightsync.adapter import serialize_tensors

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PROMPTS = [[4, 5, 13, 6, 14], [9, 10, 13]]
NAME = sglang_api.ADAPTER_NAME


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    with running_engine(tiny_model_dir, tmp_path_factory.mktemp("engine_log"),
                        ["--enable-lora"]) as url:
        yield url


def trained_policy(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       ModelConfig(path=str(model_dir), lora=LoraConfig(rank=4)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


@torch.no_grad()
def teacher_forced(model, prompt, out_ids):
    ids = torch.tensor([prompt + out_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]


def test_an_adapter_loads_serves_and_unloads_by_sglangs_routes(engine_url, tiny_model_dir):
    params = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7}
    with EngineClient(engine_url, 60, lora_path=NAME) as adapted, \
            EngineClient(engine_url, 60) as base:
        with pytest.raises(EngineError, match="never been loaded"):
            adapted.generate(PROMPTS, params)
        assert adapted.unload_lora_adapter(NAME) is False  # none held: nothing to unload
        policy = trained_policy(tiny_model_dir)
        adapter = adapter_of(policy)
        adapted.load_lora_adapter_from_tensors(NAME, adapter.config,
                                               serialize_tensors(adapter.tensors))
        adapted.update_weight_version("3")
        with_adapter = adapted.generate(PROMPTS, params)
        without = base.generate(PROMPTS, params)
        for prompt, res in zip(PROMPTS, with_adapter):
            assert res.weight_version == "3"
            # the same PEFT layers compute both sides: float32 rounding of batched rows only
            want = teacher_forced(policy, prompt, res.output_ids)
            assert max(abs(a - b) for a, b in zip(res.logprobs, want)) < 1e-5
        with policy.disable_adapter():
            for prompt, res in zip(PROMPTS, without):
                want = teacher_forced(policy, prompt, res.output_ids)
                assert max(abs(a - b) for a, b in zip(res.logprobs, want)) < 1e-5
        assert adapted.unload_lora_adapter(NAME) is True
        with pytest.raises(EngineError, match="not loaded"):
            adapted.generate(PROMPTS, params)
        # a second load under the name (what the next sync does) is served again
        adapted.load_lora_adapter_from_tensors(NAME, adapter.config,
                                               serialize_tensors(adapter.tensors))
        again = adapted.generate(PROMPTS, params)
        assert [r.output_ids for r in again] == [r.output_ids for r in with_adapter]
    resp = httpx.post(engine_url + "/load_lora_adapter_from_tensors",
                      json={"lora_name": "x", "config_dict": {}, "serialized_named_tensors":
                            ["gASVCAAAAAAAAACMAm9zlC4="]}, timeout=30)
    assert resp.status_code == 400  # a pickle naming anything but tensors is refused
