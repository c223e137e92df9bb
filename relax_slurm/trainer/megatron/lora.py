"""model.lora under trainer=megatron: megatron-bridge's CanonicalLoRA on the frozen megatron model
(docs/lora.md), with the adapter in and out under PEFT's saved names.

Why CanonicalLoRA and not megatron-bridge's `LoRA`: megatron fuses q/k/v into one `linear_qkv`
and gate/up into one `linear_fc1`. `LoRA` puts a single adapter on each fused layer, so q, k and
v would share one A (and one rank budget): not what PEFT trains on the HF model, where every
projection has an A and a B of its own. `CanonicalLoRA` puts a separate adapter on each of
q, k, v (`adapter_q/k/v`, their outputs interleaved into megatron's per-group [q, k, v] order)
and on each of gate, up (`adapter_gate/up`, concatenated as megatron's [gate; up]): exactly
PEFT's function for any subset of the seven projections, so no target set needs refusing.
`lm_head` is megatron's `output_layer` (vocab-parallel; with tied embeddings it multiplies by
the embedding weight it is handed, and the adapter adds its own output to that).

Layout at tensor parallelism (megatron's own ColumnParallelLinear / RowParallelLinear, built by
`ParallelLinearAdapter`; the parameters carry `partition_dim`):
- on a column-parallel base (linear_qkv, linear_fc1): A [r/TP, in] (split over the rank, its
  output gathered), B [out/TP, r] (split as the base's output);
- on a row-parallel base (linear_proj, linear_fc2): A [r, in/TP] (split as the base's input, its
  output all-reduced), B [out/TP, r] (output gathered).
The rank must therefore divide by TP (checked here).

Out: `AutoBridge.export_adapter_weights` gathers each adapter over TP (and PP/EP) and names it
as the HF module it adapts (`model.layers.0.self_attn.q_proj.lora_A.weight`); PEFT's saved
names add `base_model.model.` (what `trainer/lora.py::adapter_of` yields for trainer=torch).
In: the bridge's own adapter conversion tasks pair every local adapter parameter with that HF
name; each rank takes its shard of the full tensor along the parameter's `partition_dim`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from relax_slurm.checkpoint.from_lora import LORA_KEY as CHECKPOINT_KEY
from relax_slurm.config.model import LoraConfig, ModelConfig
from relax_slurm.errors import ConfigError
# one rule for merged weights under both trainers (megatron/backend.py calls it from here)
from relax_slurm.trainer.lora import check_mergeable  # noqa: F401
from relax_slurm.weightsync.adapter import Adapter

PEFT_PREFIX = "base_model.model."
"""What PEFT's saved names put before the HF module's name (get_peft_model_state_dict)."""

HF_TO_CANONICAL = {
    "q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2",
    "lm_head": "output_layer",
}
"""model.lora.target_modules (PEFT's, HF module names) -> CanonicalLoRA's targets."""


def canonical_targets(target_modules: Iterable[str]) -> list[str]:
    """CanonicalLoRA's targets for PEFT's; ConfigError naming what megatron cannot adapt."""
    targets = list(target_modules)
    unknown = [t for t in targets if t not in HF_TO_CANONICAL]
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules has {unknown}, which trainer=megatron cannot adapt: "
            f"megatron-bridge's LoRA goes on the linear layers {list(HF_TO_CANONICAL)} (HF "
            "names). Fix: model.lora.target_modules within those, or trainer=torch")
    return [HF_TO_CANONICAL[t] for t in targets]


EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")
"""PEFT's MLP targets: on an MoE model they are its routed experts, which stay frozen (below)."""


def check_no_expert_targets(target_modules: Iterable[str], what: str) -> None:
    """Refuse LoRA on the routed experts of an MoE model (`what` says how it is known to be one).

    The two trainers would not train the same thing there: transformers 5 keeps an MoE layer's
    experts as two fused 3D parameters (`mlp.experts.gate_up_proj` [E, 2I, H] and
    `down_proj`), and PEFT 0.21 turns the MLP targets into `target_parameters` on them (what
    trainer=torch trains): one rank-2r adapter per expert on gate_up_proj, its A shared by gate
    and up, and a rank-r one on down_proj. megatron-bridge's CanonicalLoRA matches the name
    `linear_fc1` / `linear_fc2` of every local expert of megatron's SequentialMLP, gives gate
    and up a rank-r adapter each (another function class) and exports them under the
    per-expert names of transformers 4 (`mlp.experts.3.gate_proj.lora_A.weight`), which PEFT's
    model of transformers 5 does not have. So the MLP targets are refused on an MoE model;
    attention (and lm_head) adapters train at any expert parallelism, the experts frozen."""
    experts = [t for t in target_modules if t in EXPERT_TARGETS]
    if experts:
        raise ConfigError(
            f"model.lora.target_modules has {experts}, which on {what} are its routed experts: "
            "trainer=megatron does not adapt MoE experts (megatron-bridge's per-expert adapters "
            "are not PEFT's adapters on transformers' fused experts; docs/lora.md). Fix: model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj] (add "
            "lm_head if wanted): the experts stay frozen")


def check_rank_split(rank: int, tensor_parallel_size: int) -> None:
    """A's rank dimension is split over TP on column-parallel layers (module docstring)."""
    if rank % tensor_parallel_size:
        raise ConfigError(
            f"model.lora.rank={rank} does not split over trainer.tensor_parallel_size="
            f"{tensor_parallel_size}: megatron-bridge shards each q/k/v/gate/up adapter's A "
            "along its rank. Fix: a rank that tensor_parallel_size divides")


def bridge_peft(cfg: ModelConfig):
    """megatron-bridge's CanonicalLoRA for model.lora (the same scale alpha / rank and input
    dropout as PEFT's LoraConfig)."""
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA

    lora = cfg.lora
    return CanonicalLoRA(target_modules=canonical_targets(lora.target_modules), dim=lora.rank,
                         alpha=lora.alpha, dropout=lora.dropout, dropout_position="pre")


def apply_lora(chunks: list, cfg: ModelConfig):
    """Adapters on the bare model chunks (before the DDP wrapping and the optimizer see them:
    Megatron DDP and its optimizer then hold the adapters only). Every base parameter is
    frozen. Returns the CanonicalLoRA object, whose `disable_adapter(chunks)` gives the base
    model (the reference policy). Its A starts random and B at zero (as PEFT's): step 0's
    policy is model.path."""
    from megatron.core import parallel_state as ps

    experts = getattr(chunks[0].config, "num_moe_experts", None)
    if experts:
        check_no_expert_targets(cfg.lora.target_modules, f"this MoE model ({experts} experts "
                                "per layer)")
    check_rank_split(cfg.lora.rank, ps.get_tensor_model_parallel_world_size())
    _fix_library()
    peft = bridge_peft(cfg)
    # (the adapters' Column/RowParallelLinear initialise their weights, which tags them
    # tensor_model_parallel with their partition_dim: the grad norm sees every shard)
    quiet = logging.getLogger("megatron.bridge.peft")  # a line per adapted layer and rank
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        peft(chunks, training=True)
    finally:
        quiet.setLevel(level)
    _drop_missing_parts(chunks)
    return peft


def _drop_missing_parts(chunks: list) -> None:
    """CanonicalLoRA keeps a None in a fused layer's ModuleDict for each part not targeted
    (adapter_k with q_proj alone); they are removed (_fix_library says why)."""
    from megatron.bridge.peft.canonical_lora import ModuleDict

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, ModuleDict):
                for key in [k for k, v in module.items() if v is None]:
                    del module[key]


def is_adapter_param(name: str) -> bool:
    return ".adapter." in name


# ---- out: PEFT names, full tensors ---------------------------------------------------------

def peft_name(hf_name: str) -> str:
    return PEFT_PREFIX + hf_name


@torch.no_grad()
def adapter_tensors(bridge, chunks: list) -> dict[str, Tensor]:
    """{PEFT saved name: full tensor} of the adapter, gathered over TP/PP/EP by the bridge.
    Collective: every rank calls it and gets every tensor."""
    return {peft_name(n): t.detach().clone()
            for n, t in bridge.export_adapter_weights(chunks, cpu=True, show_progress=False)}


def adapter_config(cfg: ModelConfig) -> dict[str, Any]:
    """PEFT's adapter_config.json for model.lora (what trainer=torch's PEFT model records)."""
    from relax_slurm.trainer.lora import jsonable, peft_config

    return jsonable(peft_config(cfg).to_dict())


def checkpoint_record(cfg: ModelConfig) -> dict[str, Any]:
    """meta.json's record of the adapter (trainer/lora.py checkpoint_record's fields)."""
    return {"base_model_path": cfg.path, "adapter_config": adapter_config(cfg)}


def recorded_model_config(record: dict[str, Any], config_dir: str | Path) -> ModelConfig:
    """The model.lora a checkpoint's record (checkpoint_record) was trained with, on the model
    in `config_dir`: what relax-convert builds the adapters from to read them back."""
    peft = record["adapter_config"]
    return ModelConfig(path=str(config_dir), lora=LoraConfig(
        rank=peft["r"], alpha=peft["lora_alpha"], dropout=peft["lora_dropout"],
        target_modules=list(peft["target_modules"])))


def adapter_of(bridge, chunks: list, cfg: ModelConfig, dtype: torch.dtype | None = None
               ) -> Adapter:
    """What an adapter-only weight sync sends (as trainer/lora.py's adapter_of). Collective."""
    tensors = adapter_tensors(bridge, chunks)
    if dtype is not None:
        tensors = {n: t.to(dtype) for n, t in tensors.items()}
    return Adapter(adapter_config(cfg), tensors)


# ---- in: PEFT names -> this rank's shards --------------------------------------------------

def local_shard(full: Tensor, param: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's part of a full adapter tensor: split along the parameter's partition_dim
    when megatron shards it, the whole tensor otherwise."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


def local_adapter_params(bridge, chunks: list) -> dict[str, Tensor]:
    """{PEFT saved name: this rank's adapter parameter}, paired by the bridge's own adapter
    conversion tasks (the names its export gives). Collective (gathers names over PP)."""
    tasks = bridge._model_bridge.build_adapter_conversion_tasks(chunks)
    out: dict[str, Tensor] = {}
    for adapter_tasks in tasks.values():
        for task in adapter_tasks:
            for sub in (task.linear_in_task, task.linear_out_task):
                if sub.param_weight is not None:  # None: on another pipeline stage
                    out[peft_name(sub.mapping.hf_param)] = sub.param_weight
    return out


@torch.no_grad()
def load_adapter(bridge, chunks: list, tensors: dict[str, Tensor]) -> None:
    """Set the adapter from full tensors under PEFT's saved names (e.g. PEFT's
    get_peft_model_state_dict): each rank copies its shard. Every adapter of the model must be
    given, and nothing else."""
    from megatron.core import parallel_state as ps

    params = local_adapter_params(bridge, chunks)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"adapter tensors missing for {missing[:4]} ({len(missing)} in all)")
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, param in params.items():
        shard = local_shard(tensors[name], param, tp_rank, tp)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: shard {tuple(shard.shape)} for a parameter of "
                             f"{tuple(param.shape)} at TP rank {tp_rank}/{tp}")
        param.copy_(shard)


# ---- megatron-bridge fixes ----------------------------------------------------------------

def _fix_library() -> None:
    """Five fixes to megatron-bridge 0.3.1's PEFT, applied once:

    - without transformer-engine (CPU), megatron.core.extensions.transformer_engine still
      imports with MagicMock placeholders for its classes, so megatron-bridge's peft/utils.py
      sees HAVE_TE=True and `isinstance(m, <MagicMock>)` raises TypeError: its TE branches are
      turned off (with a GPU and TE installed nothing changes).
    - `LoRALinearSplitQKV._interleave_qkv` reshapes the adapters' q/k/v outputs with the
      model's *global* head and group counts. A TP rank holds heads/TP and groups/TP, so its
      reshape folds TP tokens into one row: right by luck when the token count divides by TP,
      a RuntimeError otherwise (an odd micro-batch at TP=2). The same interleave with the
      rank's own counts (read off the tensors) replaces it.
    - its merged HF export (`_merge_lora_adapter_weights`: a merged sync, save_hf) handles a
      fused q/k/v or gate/up layer only with every part adapted: one CanonicalLoRA adapter
      alone (q_proj without k and v) went down the plain LoRA path, which splits a fused
      adapter's B into q/k/v (a reshape error), and two of three raised "Adapter name mapping
      not found" for the third. The parts with an adapter are merged by the bridge's own
      canonical merge, the others pass through as they are.
    - and its forward of such a layer calls every part's adapter, None for a part not
      targeted ("'NoneType' object is not callable"): a part without an adapter adds nothing
      (`_fix_partial_canonical_forward`; with every part adapted the bridge's forward runs).
      Its walks (disable_adapter) and sharded_state_dict (checkpoints) step into those None
      entries too: apply_lora removes them (`_drop_missing_parts`).
    - and under pipeline parallelism an adapter on a tied `lm_head` breaks the last stage,
      whose output layer holds its own copy of the embeddings: megatron-core reads it as
      `output_layer.weight`, which the adapter's wrapper does not have
      (`_fix_tied_output_weight`).
    """
    from megatron.bridge.peft import canonical_lora
    from megatron.bridge.peft import utils as peft_utils

    from relax_slurm.trainer.megatron import cpu_compat

    if cpu_compat.needed():
        peft_utils.HAVE_TE = False
    _fix_partial_canonical_merge()
    _fix_partial_canonical_forward()
    _fix_tied_output_weight()
    cls = canonical_lora.LoRALinearSplitQKV
    if getattr(cls._interleave_qkv, "_relax_local_heads", False):
        return

    def interleave_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        config = self.to_wrap.config
        head_size = config.kv_channels or config.hidden_size // config.num_attention_heads
        heads, groups = query.size(-1) // head_size, key.size(-1) // head_size
        return interleave_local_qkv(query, key, value, heads, groups, head_size)

    interleave_qkv._relax_local_heads = True
    cls._interleave_qkv = interleave_qkv


def _fix_tied_output_weight() -> None:
    """`_fix_library`'s fifth fix: a last pipeline stage's tied output weight read through the
    adapter's wrapper (the embeddings' gradient all-reduce and the logits use it)."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_model import GPTModel

    for cls in (LanguageModule, GPTModel):
        original = cls.__dict__.get("shared_embedding_or_output_weight")
        if original is None or getattr(original, "_relax_wrapped_output", False):
            continue

        def shared(self, _original=original):
            layer = getattr(self, "output_layer", None)
            first = self.pre_process or getattr(self, "mtp_process", False)
            if isinstance(layer, AdapterWrapper) and self.post_process and not first:
                return layer.to_wrap.weight
            return _original(self)

        shared._relax_wrapped_output = True
        cls.shared_embedding_or_output_weight = shared


def _fix_partial_canonical_merge() -> None:
    """`_fix_library`'s third fix: merge the adapted parts of a fused layer, keep the rest."""
    from megatron.bridge.models.conversion import peft_bridge

    cls = peft_bridge.MegatronPeftBridge
    merge = cls._merge_lora_adapter_weights
    if getattr(merge, "_relax_partial", False):
        return
    canonical = peft_bridge.ADAPTER_NAME_MAP  # HF weight suffix -> CanonicalLoRA adapter key

    def merge_lora_adapter_weights(self, megatron_model, converted_weights_dict, adapter_weights):
        keys = {w.adapter_key for w in adapter_weights}
        if not adapter_weights or not keys <= set(canonical.values()):
            return merge(self, megatron_model, converted_weights_dict, adapter_weights)
        adapted = {name: w for name, w in converted_weights_dict.items()
                   if any(name.endswith(suffix) and key in keys
                          for suffix, key in canonical.items())}
        merged = self._merge_canonical_adapter_from_weights(megatron_model, adapted,
                                                            adapter_weights)
        return {**converted_weights_dict, **merged}

    merge_lora_adapter_weights._relax_partial = True
    cls._merge_lora_adapter_weights = merge_lora_adapter_weights


def _fix_partial_canonical_forward() -> None:
    """`_fix_library`'s fourth fix: LoRALinearSplitQKV / LoRALinearSplitFC1UpGate with some
    parts not adapted add the adapted parts' outputs at their places in megatron's fused
    layout ([q heads of a group, k, v] per query group; [gate; up]) and nothing elsewhere."""
    from megatron.bridge.peft import canonical_lora

    qkv, fc1 = canonical_lora.LoRALinearSplitQKV, canonical_lora.LoRALinearSplitFC1UpGate
    if getattr(qkv.forward, "_relax_partial", False):
        return
    qkv_forward, fc1_forward = qkv.forward, fc1.forward

    def qkv_partial(self, x: Tensor, *args: Any, **kwargs: Any):
        parts = [getattr(self.adapter, f"adapter_{p}", None) for p in "qkv"]
        if all(part is not None for part in parts):
            return qkv_forward(self, x, *args, **kwargs)
        out, bias, layernorm_output = self.base_linear_forward(x, *args, **kwargs)
        if not self._adapter_enabled:
            return out, bias
        config = self.to_wrap.config
        d = config.kv_channels or config.hidden_size // config.num_attention_heads
        per_group = config.num_attention_heads // config.num_query_groups
        lead = out.shape[:-1]
        delta = torch.zeros_like(out).view(*lead, -1, per_group + 2, d)  # this rank's groups
        for part, lo, hi in zip(parts, (0, per_group, per_group + 1),
                                (per_group, per_group + 1, per_group + 2)):
            if part is not None:
                delta[..., lo:hi, :] = part(layernorm_output).view(*lead, -1, hi - lo, d)
        return out + delta.view_as(out), bias

    def fc1_partial(self, x: Tensor, *args: Any, **kwargs: Any):
        gate = getattr(self.adapter, "adapter_gate", None)
        up = getattr(self.adapter, "adapter_up", None)
        if gate is not None and up is not None:
            return fc1_forward(self, x, *args, **kwargs)
        out, bias, layernorm_output = self.base_linear_forward(x, *args, **kwargs)
        if not self._adapter_enabled:
            return out, bias
        y = (gate or up)(layernorm_output)
        delta = torch.cat([y, torch.zeros_like(y)] if gate is not None
                          else [torch.zeros_like(y), y], dim=-1)
        return out + delta, bias

    qkv_partial._relax_partial = fc1_partial._relax_partial = True
    qkv.forward, fc1.forward = qkv_partial, fc1_partial


def interleave_local_qkv(query: Tensor, key: Tensor, value: Tensor, heads: int, groups: int,
                         head_size: int) -> Tensor:
    """[..., heads * d], [..., groups * d] x2 -> megatron's fused layout [..., groups x
    (heads/groups q heads, 1 k head, 1 v head) x d], per token."""
    lead = query.shape[:-1]
    q = query.reshape(*lead, groups, heads // groups, head_size)
    k = key.reshape(*lead, groups, 1, head_size)
    v = value.reshape(*lead, groups, 1, head_size)
    return torch.cat([q, k, v], dim=-2).reshape(*lead, -1)


# ---- the reference policy --------------------------------------------------------------------

class AdapterDisabled:
    """The reference policy of the KL loss: the megatron policy with its adapters off, which is
    model.path itself (CanonicalLoRA's disable_adapter), with no second copy of the weights.
    Its log-probs come as the sharded reference's (megatron/reference.py): Megatron's
    forward-only schedule over the update's micro-batches (step.forward_logprobs: each TP
    rank's vocabulary slice, every layout), the adapters off around it."""

    def __init__(self, peft) -> None:
        self._peft = peft

    def with_logprobs(self, mm, batch, num_steps: int, micro_batch_size: int,
                      temperature: float):
        """The rows with `ref_logp` [rows, T-1]; collective, as the policy's forward."""
        import dataclasses

        from relax_slurm.trainer.megatron.step import forward_logprobs

        with self._peft.disable_adapter(mm.chunks):
            logp = forward_logprobs(mm, mm.chunks, batch, None, num_steps, micro_batch_size,
                                    temperature)
        return dataclasses.replace(batch, ref_logp=logp)
