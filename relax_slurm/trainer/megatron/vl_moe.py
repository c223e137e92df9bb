"""Qwen3-VL-MoE under trainer=megatron: the experts of megatron-core's SequentialMLP.

megatron-bridge 0.3.1 (qwen_vl/qwen3_vl_bridge.py, Qwen3VLMoEBridge) maps the experts only under
transformer-engine's grouped-GEMM names (`mlp.experts.linear_fc1.weight<N>`). Without
transformer-engine (CPU) megatron-core builds a SequentialMLP whose experts are
`mlp.experts.local_experts.<n>.linear_fc1.weight` (fc1 = [gate; up], [2I, H]) and
`...linear_fc2.weight` ([H, I]); `model.fix_sequential_experts` turns the local n into the
global expert number, as for text Qwen3-MoE. Here those names get mappings to the checkpoint's
fused tensors `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, reusing the bridge's own
expert conversions (TP split of gate and up, EP gather, the merge of all experts on export).

Two file layouts exist for the fused tensors, and the export must give back the file's:
- Qwen's released checkpoints: gate_up_proj [E, H, 2I], down_proj [E, I, H] (the bridge's);
- files written by transformers 5 (`save_pretrained`, e.g. tools/make_tiny_model.py): its
  in-memory layout [E, 2I, H] and [E, H, I]. transformers 5 transposes Qwen's on load
  (conversion_mapping.py "qwen3_vl_moe", Transpose(1, 2, check_dims=True)) and saves its own.
Which one a file holds is read from its shape (the safetensors header, not the tensor); a shape
that fits both (H == 2I, or H == I) is refused rather than guessed.

The load-balancing loss's weight is the checkpoint's `router_aux_loss_coef` (the bridge fixes
it at 1e-3, Qwen's released value). The bridge's MoE provider also freezes the language model
and the vision tower by default (qwen3_vl_provider.py:232-233, `freeze_language_model=True`,
`freeze_vision_model=True`); trainer=megatron freezes only what `trainer.freeze_modules`
names, so both are turned off.

Its finalize turns sequence parallelism on at TP > 1 (qwen3_vl_provider.py:247-250), over
`build_provider`'s off, and is left so: megatron-core trains MoE layers under TP only with it
(moe_layer.py:379). The DeepStack features are then split over the TP ranks, and the
replicated vision tower gets the whole gradient through vl.split_deepstack (logits and tower
gradients equal transformers' at TP=2 on CPU: test_megatron_vl.py `vl3moe_tp2`); the routing
replay's mapping of each TP rank's slice (routing.py) is untested there.
"""

from __future__ import annotations

from torch import Tensor

from relax_slurm.errors import ConfigError
from relax_slurm.modeling import checkpoint_shapes

GATE_UP, DOWN = "gate_up_proj", "down_proj"
LAYER = "language_model.decoder.layers.*.mlp.experts.local_experts.*"
GROUPED = "language_model.decoder.layers.*.mlp.experts"
HF_LAYER = "model.language_model.layers.*.mlp.experts"

_APPLIED = False


def is_transformers_layout(kind: str, shape: tuple[int, ...], hidden: int, ffn: int) -> bool:
    """Whether a fused expert tensor of `shape` is in transformers 5's layout (else Qwen's);
    ConfigError if it is neither or could be both."""
    qwen, hf = checkpoint_shapes(kind.endswith(GATE_UP), shape[0], hidden, ffn)
    if qwen == hf:
        raise ConfigError(
            f"trainer=megatron: the Qwen3-VL-MoE experts' {kind} {list(shape)} reads the same in "
            f"Qwen's layout and in transformers 5's (hidden_size={hidden}, "
            f"moe_intermediate_size={ffn}), so which one the file holds is unknown. Fix: "
            "trainer=torch (docs/backends.md#multimodal-models)")
    if tuple(shape) not in (qwen, hf):
        raise ConfigError(f"trainer=megatron: the Qwen3-VL-MoE experts' {kind} has shape "
                          f"{list(shape)}; expected {list(qwen)} (Qwen's layout) or {list(hf)} "
                          "(transformers 5's)")
    return tuple(shape) == hf


def _as_qwen_layout(kind: str, fused: Tensor, config) -> Tensor:
    """The file's fused tensor in Qwen's layout (a view), which the bridge's mappings index."""
    if is_transformers_layout(kind, tuple(fused.shape), config.hidden_size,
                              config.moe_ffn_hidden_size):
        return fused.transpose(1, 2)
    return fused


def file_shape(hf_state, name: str) -> tuple[int, ...] | None:
    """A tensor's shape in the checkpoint without loading it: the safetensors header when the
    bridge reads files, else the tensor it holds (relax-convert: meta tensors)."""
    source = getattr(hf_state, "source", None)
    names = getattr(source, "key_to_filename_map", None)
    if names and name in names:
        from relax_slurm.checkpoint.hf_files import file_shapes

        return file_shapes(source.path / names[name])[name]
    try:
        return tuple(hf_state[name].shape)
    except KeyError:
        return None


def _expert_mappings(qb) -> dict[str, list]:
    """The experts' names -> the fused tensors, through the bridge's own expert mappings given
    the fused tensor in Qwen's layout whichever the file holds: SequentialMLP's names (CPU;
    tested), and the grouped-GEMM names, to go ahead of the bridge's own (the registry takes
    the first match), so a file in transformers 5's layout loads on GPUs too (unverified)."""

    class GateUp(qb.ExpertMLPGateUpProjMapping):
        def hf_to_megatron(self, hf_weights, megatron_module):
            fused = _as_qwen_layout(GATE_UP, hf_weights, self._get_config(megatron_module))
            return super().hf_to_megatron(fused, megatron_module)

    class Down(qb.ExpertMLPDownProjMapping):
        def hf_to_megatron(self, hf_weights, megatron_module):
            fused = _as_qwen_layout(DOWN, hf_weights, self._get_config(megatron_module))
            return super().hf_to_megatron(fused, megatron_module)

    return {kind: [GateUp(megatron_param=f"{layer}.linear_fc1{suffix}",
                          hf_param=f"{HF_LAYER}.{GATE_UP}"),
                   Down(megatron_param=f"{layer}.linear_fc2{suffix}",
                        hf_param=f"{HF_LAYER}.{DOWN}")]
            for kind, layer, suffix in (("sequential", LAYER, ".weight"),
                                        ("grouped", GROUPED, ".weight*"))}


def apply() -> None:
    """The mappings, the export's layout and the provider's fields (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.qwen_vl import qwen3_vl_bridge as qb

    bridge = qb.Qwen3VLMoEBridge
    registry, provider_bridge = bridge.mapping_registry, bridge.provider_bridge
    merge = bridge.maybe_modify_converted_hf_weight

    def mapping_registry(self):
        ours = _expert_mappings(qb)
        return MegatronMappingRegistry(*ours["grouped"], *registry(self).mappings,
                                       *ours["sequential"])

    def maybe_modify_converted_hf_weight(self, task, converted, hf_state):
        out = merge(self, task, converted, hf_state)  # all experts merged: Qwen's layout
        cfg = self.hf_config.text_config
        for name, fused in list(out.items()):
            kind = name.rsplit(".", 1)[-1]
            if fused.dim() != 3 or kind not in (GATE_UP, DOWN) or ".mlp.experts." not in name:
                continue
            shape = file_shape(hf_state, name)
            if shape is not None and is_transformers_layout(
                    kind, shape, cfg.hidden_size, cfg.moe_intermediate_size):
                out[name] = fused.transpose(1, 2).contiguous()
        return out

    def provider_bridge_unfrozen(self, hf_pretrained):
        provider = provider_bridge(self, hf_pretrained)
        provider.freeze_language_model = provider.freeze_vision_model = False
        provider.freeze_vision_projection = False
        text = hf_pretrained.config.text_config
        rope = getattr(text, "rope_parameters", None) or {}
        if "mrope_section" in rope:
            provider.mrope_section = list(rope["mrope_section"])
        # the bridge hard-codes 1e-3 (Qwen's released value); the checkpoint's own coefficient
        provider.moe_aux_loss_coeff = float(getattr(text, "router_aux_loss_coef", 1e-3))
        return provider

    bridge.mapping_registry = mapping_registry
    bridge.maybe_modify_converted_hf_weight = maybe_modify_converted_hf_weight
    bridge.provider_bridge = provider_bridge_unfrozen
    _APPLIED = True
