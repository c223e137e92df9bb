"""Run as `python -m tests.unit.trainer.megatron_layout_probe RUN...`: each GPU preset's
megatron-core layout put through megatron-core's own checks, without a GPU, a download or the
model's weights; one JSON line per RUN on stdout ({"preset", "ok", "error", ...}). A RUN is a
preset's name, or a JSON list of it and config overrides.

For a preset: its trainer section (relax_slurm's config loader), megatron-bridge's provider
from a hand-written HF config with the released model's shapes, our `set_parallel_sizes`
(sequence parallelism included), then
- `finalize()`: TransformerConfig.__post_init__ (heads % TP, query groups vs TP, MoE fields)
  and ModelParallelConfig's (sequence parallelism needs TP; its warning "When using expert
  parallelism and tensor parallelism for training, sequence parallelism must be used" is made
  an error);
- `parallel_state.initialize_model_parallel` on a fake process group of the preset's world size
  (trainer nodes x nproc_per_node, this process as rank 0): world % (TP x PP x CP),
  world % (ETP x EP x PP), its rank generators;
- `get_num_layers_to_build` (layers % PP) and BaseMoELayer's constructor (experts % EP; it
  allocates nothing);
- MoELayer.forward's training rule, which runs only in a forward (moe_layer.py:379): an MoE
  model at TP > 1 must have sequence_parallel on.

A separate process because it holds a fake default process group of up to 16 ranks.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

QWEN3_MOE = dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936)
QWEN3_4B = dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                tie_word_embeddings=True)

# The released models' config.json shapes as recalled (no hub access here: not fetched).
# Qwen3-VL's language models have Qwen3's shapes; the vision towers are replicated on every
# TP rank (docs/backends.md), so megatron's layout checks read only the text side.
HF_SHAPES = {
    "Qwen/Qwen3-4B": ("Qwen3ForCausalLM", QWEN3_4B, None),
    "Qwen/Qwen3-30B-A3B": ("Qwen3MoeForCausalLM", QWEN3_MOE, None),
    "Qwen/Qwen3-VL-4B-Instruct": ("Qwen3VLForConditionalGeneration", QWEN3_4B,
                                  dict(depth=24, hidden_size=1024, num_heads=16,
                                       intermediate_size=4096, out_hidden_size=2560)),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ("Qwen3VLMoeForConditionalGeneration", QWEN3_MOE,
                                       dict(depth=27, hidden_size=1152, num_heads=16,
                                            intermediate_size=4304, out_hidden_size=2048)),
    # the thinker: Qwen3-30B-A3B's shapes (vocabulary 152064), Qwen3-VL-MoE's vision tower and
    # a Whisper-large-sized audio encoder, both replicated on every TP rank; the talker is not
    # built (trainer/megatron/omni.py)
    "Qwen/Qwen3-Omni-30B-A3B-Instruct": ("Qwen3OmniMoeForConditionalGeneration",
                                         dict(QWEN3_MOE, vocab_size=152064),
                                         dict(depth=27, hidden_size=1152, num_heads=16,
                                              intermediate_size=4304, out_hidden_size=2048,
                                              patch_size=16, spatial_merge_size=2,
                                              deepstack_visual_indexes=[8, 16, 24])),
}
OMNI_TOKENS = dict(image_token_id=151655, video_token_id=151656, audio_token_id=151675,
                   vision_start_token_id=151652, audio_start_token_id=151669)  # no layout role
OMNI_AUDIO = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                  encoder_ffn_dim=5120, output_dim=2048, num_mel_bins=128)


def hf_config(model_path: str):
    import transformers

    arch, text, vision = HF_SHAPES[model_path]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config")
                  .replace("ForConditionalGeneration", "Config"))
    if vision is None:
        return cls(**text, architectures=[arch], dtype="bfloat16")
    tie = text.get("tie_word_embeddings", False)
    if arch.startswith("Qwen3OmniMoe"):
        return cls(thinker_config=dict(text_config=dict(text), vision_config=vision,
                                       audio_config=OMNI_AUDIO, **OMNI_TOKENS),
                   enable_audio_output=False, architectures=[arch], dtype="bfloat16")
    return cls(text_config=dict(text), vision_config=vision, tie_word_embeddings=tie,
               architectures=[arch], dtype="bfloat16")


def provider_for(cfg, bridge_mod):
    """The bridge's provider with our parallel sizes, finalized (megatron's __post_init__)."""
    from relax_slurm.trainer.megatron import bridges, vl
    from relax_slurm.trainer.megatron.model import set_parallel_sizes

    bridges.register()  # the project's bridges (Qwen3-Omni...), as MegatronModel registers them
    config = hf_config(cfg.model.path)
    if vl.kind(config) is not None:
        vl.apply()
    provider = bridge_mod.AutoBridge.from_hf_config(config).to_megatron_provider(
        load_weights=False)
    set_parallel_sizes(provider, cfg.trainer)
    provider.params_dtype = provider.pipeline_dtype = torch.bfloat16
    provider.bf16 = True
    # fused CUDA kernels (no layout meaning) whose imports fail without transformer-engine
    for flag in ("moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm",
                 "gradient_accumulation_fusion"):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sequence parallelism must be used")
        provider.finalize()
    return provider


def check_layout(provider, world: int) -> dict:
    """megatron-core's parallel_state rules on a fake process group of `world` ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=provider.tensor_model_parallel_size,
            pipeline_model_parallel_size=provider.pipeline_model_parallel_size,
            context_parallel_size=provider.context_parallel_size,
            expert_model_parallel_size=provider.expert_model_parallel_size,
            expert_tensor_parallel_size=provider.expert_tensor_parallel_size,
            create_gloo_process_groups=False)
        out = {"dp": ps.get_data_parallel_world_size(),
               "layers_per_stage": get_num_layers_to_build(provider, pp_rank=0)}
        if provider.num_moe_experts:
            class Probe(BaseMoELayer):
                def forward(self, hidden_states):
                    raise NotImplementedError

            layer = Probe(provider, layer_number=1,
                          pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            out["local_experts"] = layer.num_local_experts
            out["tp_group"] = layer.attn_tp_group.size()
        return out
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def probe(preset: str, overrides: list[str], bridge_mod) -> dict:
    from relax_slurm.launch.submit import compose_config

    cfg = compose_config([f"experiment={preset}", "run_dir=/tmp/relax_layout_probe",
                          *overrides])
    world = cfg.trainer.nproc_per_node * cfg.cluster.trainer_node_count()
    out = {"preset": preset, "world": world}
    try:
        provider = provider_for(cfg, bridge_mod)
        out.update(check_layout(provider, world))
        out.update(sequence_parallel=bool(provider.sequence_parallel),
                   moe=bool(provider.num_moe_experts))
        if out["moe"] and out["tp_group"] > 1 and not provider.sequence_parallel:
            raise ValueError("MoELayer.forward (moe_layer.py:379) raises in training: MoE "
                             "under TP > 1 without sequence parallelism")
        out["ok"] = True
    except Exception as e:  # reported per preset, with megatron's own message
        where = traceback.extract_tb(e.__traceback__)[-1]
        out.update(ok=False, error=f"{type(e).__name__}: {e}",
                   at=f"{Path(where.filename).name}:{where.lineno}")
    return out


def main(runs: list[str]) -> None:
    from relax_slurm.trainer.megatron import cpu_compat

    warnings.simplefilter("ignore")
    bridge_mod = cpu_compat.import_bridge()
    for run in runs:
        preset, *overrides = json.loads(run) if run.startswith("[") else [run]
        print(json.dumps(probe(preset, overrides, bridge_mod)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
