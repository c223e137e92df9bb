"""The megatron backend's model: a megatron-core GPTModel built from the HF checkpoint through
megatron-bridge, wrapped in Megatron DDP, with Megatron's optimizer.

Parallel sizes come from `trainer.tensor_parallel_size`, `pipeline_parallel_size`,
`context_parallel_size` and `expert_parallel_size`; data parallelism is what remains of the
world. Weights leave the model only through the bridge (`named_hf_weights`): HF names, full
tensors gathered across TP/PP/EP, on every rank.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.modeling import media_token_ids
from relax_slurm.trainer.megatron import bridges, context_parallel, cpu_compat, vl
from relax_slurm.trainer.megatron.pad_embedding import skip_padding_embedding_grads
from relax_slurm.trainer.schedule import lr_factor

log = logging.getLogger("relax_slurm.trainer.megatron")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_model_parallel(cfg: TrainerConfig) -> None:
    """Megatron's process groups (TP, PP, CP, EP; DP is the rest) and its RNG streams."""
    from megatron.core import parallel_state as ps

    cuda, te = context_parallel.machine_support()
    reason = context_parallel.refusal(cfg.context_parallel_size, cuda=cuda, te=te)
    if reason is not None:
        raise ConfigError(reason)
    world = dist.get_world_size()
    model_parallel = (cfg.tensor_parallel_size * cfg.pipeline_parallel_size
                      * cfg.context_parallel_size)
    if world % model_parallel:
        raise ConfigError(
            f"{world} trainer ranks do not split into tensor_parallel_size="
            f"{cfg.tensor_parallel_size} x pipeline_parallel_size={cfg.pipeline_parallel_size} x "
            f"context_parallel_size={cfg.context_parallel_size}; change trainer.nproc_per_node "
            "or the parallel sizes")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
    )
    if not cpu_compat.activate(cfg.seed):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def data_ranks() -> list[int]:
    """The data-parallel index of every global rank (TP/PP/CP peers share their rows)."""
    from megatron.core import parallel_state as ps

    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, ps.get_data_parallel_rank())
    return out


def build_provider(bridge, model_cfg: ModelConfig, cfg: TrainerConfig, load_weights: bool = True):
    """The bridge's model provider for the HF model, with our parallel sizes and dtype."""
    dtype = DTYPES[model_cfg.dtype]
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    set_parallel_sizes(provider, cfg)
    set_recompute(provider, cfg.recompute)
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.autocast_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    # RL: the policy the engines sample from has no dropout; train the same function
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    provider.towers = cfg.towers  # the multimodal forwards read it (tower_split.is_split)
    # from_hf_config (relax-convert) holds the config itself, from_hf_pretrained the model
    hf_config = getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)
    theta = rope_theta(hf_config)
    if theta is not None:
        provider.rotary_base = theta
    if (hf_config.get_text_config() is not hf_config
            and hasattr(hf_config, "tie_word_embeddings")):
        # multimodal: transformers 5 keeps the tied-embeddings flag on the top-level config only
        # (Qwen3-Omni: on its thinker's, which omni_bridge reads)
        provider.share_embeddings_and_output_weights = bool(hf_config.tie_word_embeddings)
    if cpu_compat.needed():
        # no transformer-engine, no fused CUDA kernels: megatron-core's local layers
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
        for flag in ("gradient_accumulation_fusion", "bias_activation_fusion",
                     "masked_softmax_fusion", "apply_rope_fusion", "bias_dropout_fusion",
                     "persist_layer_norm", "moe_permute_fusion", "moe_grouped_gemm",
                     "moe_router_fusion"):
            if hasattr(provider, flag):
                setattr(provider, flag, False)
        if getattr(provider, "num_moe_experts", None):
            # the alltoall dispatcher copies token counts on a CUDA side-stream
            provider.moe_token_dispatcher_type = "allgather"
            # VL-MoE models at TP > 1 (sequence parallelism) included: Qwen3-VL-MoE's and
            # Qwen3-Omni's DeepStack gradient split over the ranks is reduced (vl.split_deepstack)
    if getattr(provider, "num_moe_experts", None):
        # a RouterReplay per router (idle unless routing replay hands it the rollout's experts)
        provider.moe_enable_routing_replay = True
        # megatron-bridge's Qwen3-MoE bridge hard-codes the load-balancing loss's weight at 1e-3
        # (qwen3_moe_bridge.py:58, Qwen's released value): the checkpoint's own, as trainer=torch
        coef = getattr(hf_config.get_text_config(), "router_aux_loss_coef", None)
        if coef is not None:
            provider.moe_aux_loss_coeff = float(coef)
    provider.finalize()
    return provider


def provide_chunks(bridge, model_cfg: ModelConfig, cfg: TrainerConfig, dtype: torch.dtype
                   ) -> tuple[list, bool]:
    """model.path's chunks (one per virtual pipeline stage) built by the bridge at our parallel
    sizes, unwrapped, TP parameters marked; and whether sequence parallelism is on. The policy,
    the critic and the KL reference (megatron/reference.py) are all built here."""
    provider = build_provider(bridge, model_cfg, cfg)
    # wrapped in Megatron DDP by ddp_chunks rather than by the bridge, whose wrapper opens a
    # CUDA side-stream (for CUDA graphs) that a CPU build cannot create
    bare = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=cpu_compat.needed(),
        data_parallel_random_init=False,
        mixed_precision_wrapper=None if dtype == torch.float32 else _float16_module())
    for chunk in bare:
        mark_tensor_parallel(chunk)
    return bare, bool(provider.sequence_parallel)


def set_parallel_sizes(provider, cfg: TrainerConfig) -> None:
    """Our TP/PP/CP/EP sizes on the bridge's provider, and sequence parallelism where
    megatron-core requires it: on for an MoE model at TP > 1, off otherwise.

    megatron-core 0.16's MoELayer.forward raises ValueError in training when the attention's
    TP group has more than one rank and `sequence_parallel` is off (moe_layer.py:379; its
    ModelParallelConfig.__post_init__ only warns for EP > 1 with TP > 1): an error in the first
    training step, not a silent wrong result. So a GPU preset with MoE at TP=2
    (qwen3_30b_a3b_dapo, qwen3_vl_30b_a3b_openr1) needs it on; the bridge's Qwen3-VL-MoE
    provider turns it on in its finalize anyway (qwen3_vl_provider.py:247-250). Dense models
    keep it off (nothing requires it; on CPU the local layers' torch norms take it only through
    cpu_compat). Routing replay maps each TP rank's slice of the sequence (routing.py)."""
    provider.tensor_model_parallel_size = cfg.tensor_parallel_size
    provider.pipeline_model_parallel_size = cfg.pipeline_parallel_size
    provider.context_parallel_size = cfg.context_parallel_size
    provider.expert_model_parallel_size = cfg.expert_parallel_size
    provider.sequence_parallel = needs_sequence_parallel(
        getattr(provider, "num_moe_experts", None), cfg.tensor_parallel_size)


def set_recompute(provider, recompute: str) -> None:
    """trainer.recompute on megatron-core's TransformerConfig: full recomputes every layer from
    its input (method uniform, one layer per checkpoint), selective the core attention alone
    (megatron-core's default selective module); none leaves its defaults (no recompute)."""
    if recompute == "full":
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = 1
    elif recompute == "selective":
        provider.recompute_granularity = "selective"


def needs_sequence_parallel(num_moe_experts: int | None, tensor_parallel_size: int) -> bool:
    """megatron-core trains MoE layers under TP only with sequence parallelism (above)."""
    return bool(num_moe_experts) and tensor_parallel_size > 1


def rope_theta(hf_config) -> float | None:
    """The model's RoPE base. megatron-bridge 0.3.1 maps the HF field `rope_theta`
    (conversion/model_bridge.py CONFIG_MAPPING), which transformers 5 moved into
    `rope_parameters`: without this every model trained with rotary_base=10000 whatever its
    checkpoint says (Qwen3: 1e6), silently. VL models keep it in their text config."""
    text = hf_config.get_text_config()
    params = getattr(text, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(text, "rope_theta", None)
    return None if theta is None else float(theta)


class MegatronModel:
    """Model chunks (one per virtual pipeline stage), optimizer and the bridge they came from."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainerConfig, *, bridge=None,
                 adapt: Callable[[list], None] | None = None) -> None:
        """`bridge`: one already built for model.path (the critic shares the policy's);
        `adapt`: changes the bare chunks before the DDP wrapping and the optimizer see them
        (the critic's value head in place of the LM head: megatron/critic.py)."""
        self.cfg = cfg
        self.sequence_parallel = False  # build_provider's decision, once the chunks are built
        dtype = DTYPES[model_cfg.dtype]
        bridge_mod = cpu_compat.import_bridge()
        bridges.register()  # the project's: Qwen3-Omni, Qwen2-Audio (megatron-bridge has none)
        fix_sequential_experts()
        check_cpu_dtype(model_cfg.dtype, dtype)
        self.bridge = bridge or bridge_mod.AutoBridge.from_hf_pretrained(
            model_cfg.path, torch_dtype=dtype, trust_remote_code=model_cfg.trust_remote_code)
        hf_config = self.bridge.hf_pretrained.config
        self.vl = vl.kind(hf_config)  # None: a text decoder
        # media pad tokens, which the engines never sample: out of the policy's softmax, as
        # under trainer=torch (modeling.media_token_ids; empty for text models)
        self.banned_ids = list(media_token_ids(hf_config))
        if self.vl is not None:
            check_vl_parallel(cfg)
            vl.apply()
        if cfg.towers == "split" and dist.get_rank() == 0:
            if self.vl is not None and cfg.tensor_parallel_size > 1:
                log.info("trainer.towers=split: each of the %d TP ranks encodes its share of a "
                         "micro-batch's media", cfg.tensor_parallel_size)
            else:
                log.info("trainer.towers=split: nothing to split (a text model, or TP=1)")
        self.vocab_size = hf_config.get_text_config().vocab_size
        check_vocab_split(self.vocab_size, cfg.tensor_parallel_size)
        bare = self._bare_chunks(model_cfg, cfg, dtype)
        skip_padding_embedding_grads(bare, hf_config.get_text_config().pad_token_id)
        if adapt is not None:
            adapt(bare)
        self.chunks = ddp_chunks(bare, cfg.use_distributed_optimizer)
        self.optimizer = megatron_optimizer(cfg, dtype, self.chunks)
        self.steps_done = 0  # optimizer steps: the lr schedule's position

    def _bare_chunks(self, model_cfg: ModelConfig, cfg: TrainerConfig, dtype: torch.dtype) -> list:
        """The model's chunks (one per virtual pipeline stage) from the bridge, unwrapped, TP
        parameters marked and `trainer.freeze_modules` frozen."""
        bare, self.sequence_parallel = provide_chunks(self.bridge, model_cfg, cfg, dtype)
        if cfg.freeze_modules:
            freeze(bare, [vl.hf_prefix_to_megatron(self.vl, p) if self.vl else p
                          for p in cfg.freeze_modules], cfg.freeze_modules)
        return bare

    # ---- lr schedule -------------------------------------------------------------------------
    def lr_now(self) -> float:
        cfg = self.cfg
        return cfg.lr * lr_factor(self.steps_done,
                                  total_steps=cfg.lr_decay_steps or cfg.total_steps,
                                  warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                                  min_lr_ratio=cfg.min_lr_ratio)

    def set_lr(self) -> float:
        lr = self.lr_now()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, chunk, input_ids: Tensor, positions: Tensor | None = None,
                attention_mask: Tensor | None = None,
                media: dict[str, Tensor] | None = None) -> Tensor:
        """One chunk's output: vocab-parallel logits [B, T, V/TP] on the last pipeline stage,
        hidden states elsewhere. Rows are right-padded, so the causal mask is the whole mask.
        With context parallelism, `input_ids` are this rank's chunks at `positions` [T] and
        transformer-engine's attention applies the causal mask across the CP ring. A
        vision-language model takes the rows' media (`MicroBatch.media.kwargs()`) and their
        [B, T] padding mask (its M-RoPE positions skip padding)."""
        if positions is None:
            input_ids, attention_mask = self._pad_for_sequence_parallel(input_ids, attention_mask)
        B, T = input_ids.shape
        if self.vl is not None:  # text-only rows too: M-RoPE's 3-D positions
            return vl.forward(self.vl, chunk, input_ids, attention_mask, media or {})
        if positions is not None:
            return chunk(input_ids, positions.unsqueeze(0).expand(B, T), None)
        pos = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1).view(1, 1, T, T)
        return chunk(input_ids, pos, mask)

    def seq_length(self, width: int, cp: int) -> int:
        """The sequence length each micro-batch of `width` tokens is run at."""
        if cp > 1:
            return context_parallel.padded_length(width, cp, self.sp_size)
        if self.sequence_parallel:
            return -(-width // self.cfg.tensor_parallel_size) * self.cfg.tensor_parallel_size
        return width

    @property
    def sp_size(self) -> int:
        """How many ranks sequence parallelism splits a sequence over: TP, or 1 without it."""
        return self.cfg.tensor_parallel_size if self.sequence_parallel else 1

    def _pad_for_sequence_parallel(self, input_ids: Tensor, attention_mask: Tensor | None
                                   ) -> tuple[Tensor, Tensor | None]:
        """Rows right-padded (token 0, mask 0, after every real token: the causal mask keeps
        them out) to a multiple of TP: sequence parallelism splits the sequence over the TP
        ranks (megatron-core mappings.py _split_along_first_dim asserts it divides; the bridge's
        Qwen3-VL model does not pad either); callers cut the logits back to the rows' width."""
        B, T = input_ids.shape
        extra = self.seq_length(T, 1) - T
        if extra == 0:
            return input_ids, attention_mask
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(B, extra)], 1)
        return torch.cat([input_ids, input_ids.new_zeros(B, extra)], dim=1), attention_mask

    def full_logits(self, output: Tensor) -> Tensor:
        """Vocab-parallel logits -> the HF vocabulary's logits [B, T, V] (padding dropped)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if self.cfg.tensor_parallel_size > 1:
            output = gather_from_tensor_model_parallel_region(output)
        return output[..., :self.vocab_size]

    # ---- weights -----------------------------------------------------------------------------
    def named_hf_weights(self, cpu: bool = True) -> Iterator[tuple[str, Tensor]]:
        """HF-named full tensors through the bridge. Collective: every rank iterates. `cpu`:
        each moved to host memory (a copy kept beyond the next tensor must not hold GPU
        memory); a streamed sync reads them where they were gathered."""
        for name, t in self.bridge.export_hf_weights(self.chunks, cpu=cpu, show_progress=False):
            yield name, t.detach()

    def train(self) -> None:
        for c in self.chunks:
            c.train()


def check_cpu_dtype(name: str, dtype: torch.dtype) -> None:
    if cpu_compat.needed() and dtype != torch.float32:
        raise ConfigError(
            f"trainer=megatron on CPU trains in float32 only (model.dtype={name}): "
            "megatron-core's mixed-precision optimizer wraps CUDA tensors; set "
            "model.dtype=float32 or use trainer=torch")


def check_vl_parallel(cfg: TrainerConfig) -> None:
    if cfg.pipeline_parallel_size > 1 or cfg.context_parallel_size > 1:
        raise ConfigError(
            "trainer=megatron with a vision-language model supports tensor "
            f"parallelism only (pipeline_parallel_size={cfg.pipeline_parallel_size}, "
            f"context_parallel_size={cfg.context_parallel_size}): set both to 1 "
            "(docs/backends.md#multimodal-models)")


def check_vocab_split(vocab_size: int, tensor_parallel_size: int) -> None:
    if vocab_size % tensor_parallel_size:
        raise ConfigError(
            f"the model's vocab_size={vocab_size} does not split over "
            f"trainer.tensor_parallel_size={tensor_parallel_size}: megatron-bridge loads "
            "the embedding unpadded. Fix: a tensor_parallel_size dividing it, or pad the "
            "checkpoint's vocabulary (config.json vocab_size and the embedding rows)")


def ddp_chunks(bare: list, use_distributed_optimizer: bool) -> list:
    """The chunks in Megatron DDP, with the model config's hooks that make the schedule
    all-reduce gradients over data-parallel ranks."""
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer)
    chunks = [DistributedDataParallel(config=c.config, ddp_config=ddp, module=c,
                                      disable_bucketing=i > 0)
              for i, c in enumerate(bare)]
    config = chunks[0].config
    # without it Megatron DDP never all-reduces the gradients over data-parallel ranks
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks]
    if len(chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
    return chunks


def megatron_optimizer(cfg: TrainerConfig, dtype: torch.dtype, chunks: list):
    """Megatron's Adam over the chunks (trainer.lr, betas, weight decay, grad clip)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.grad_clip,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer), chunks)


def freeze(chunks, prefixes: list[str], hf_prefixes: list[str]) -> None:
    """`trainer.freeze_modules` (HF names, mapped to megatron's by the caller): these
    parameters get no gradient buffer and no optimizer state; they still go to the engines."""
    for prefix, hf in zip(prefixes, hf_prefixes):
        hits = [p for c in chunks for n, p in c.named_parameters()
                if n == prefix or n.startswith(prefix + ".")]
        if not hits:
            tops = sorted({n.split(".")[0] for c in chunks for n, _ in c.named_parameters()})
            raise ConfigError(f"trainer.freeze_modules: {hf!r} matches no parameter of the "
                              f"megatron model (looked for {prefix!r}). Fix: a module prefix, "
                              f"e.g. model.visual or one of {tops}")
        for p in hits:
            p.requires_grad_(False)


def fix_sequential_experts() -> None:
    """megatron-bridge 0.3.1 knows expert numbers only in the grouped-GEMM parameter names
    (`experts.linear_fc1.weight<N>`). megatron-core's SequentialMLP (what runs without
    transformer-engine's grouped GEMM, e.g. on CPU) names them `experts.local_experts.<n>.
    linear_fc1.weight` with a *local* n, so under expert parallelism the bridge loaded every
    EP rank's experts from HF experts 0..E/EP-1 and its export could not parse the number.
    Here local numbers become global ones (as the bridge does for grouped names), and the EP
    gather is given the number in the form it parses.

    The export pairs the EP ranks' experts by position in each rank's sorted name list (the
    i-th expert of every rank is all-gathered together), and the bridge's sort key reads an
    expert number only after `weight`/`bias`: these names then sorted as strings, so with 16
    experts rank 1's came as 10, 11, ..., 15, 8, 9 against rank 0's 0..7, and the export named
    HF expert 12 `experts.10` (every expert of EP rank 1 shifted; with 4 experts, as in
    test_megatron_parallel.py, the strings sort like the numbers). The sort key reads the
    `local_experts.<n>` number too."""
    import re

    from megatron.bridge.models.conversion import model_bridge as mb
    from megatron.bridge.models.conversion import param_mapping as pm
    from megatron.core import parallel_state as ps

    sort_key = mb.extract_sort_key
    if not getattr(sort_key, "_relax_sequential", False):
        def extract_sort_key(param_name: str):
            numbers, name = sort_key(param_name)
            m = re.search(r"\.local_experts\.(\d+)\.", param_name)
            if m is not None and numbers[1] == -1:
                numbers = [numbers[0], int(m.group(1))]
            return numbers, name

        extract_sort_key._relax_sequential = True
        mb.extract_sort_key = extract_sort_key

    to_global = mb._megatron_local_name_to_global
    if not getattr(to_global, "_relax_sequential", False):
        def local_name_to_global(models, config, param_name, vp_stage=None):
            name = to_global(models, config, param_name, vp_stage)
            m = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.", name)
            ep = ps.get_expert_model_parallel_world_size()
            if m is None or ep == 1 or ".adapter." in name:
                return name
            per_rank = config.num_moe_experts // ep
            first = per_rank * ps.get_expert_model_parallel_rank()
            return (name[:m.start(1)] + str(first + int(m.group(1))) + name[m.end(1):])

        local_name_to_global._relax_sequential = True
        mb._megatron_local_name_to_global = local_name_to_global

    original = pm.MegatronParamMapping.gather_from_ep_ranks
    if getattr(original, "_relax_sequential", False):
        return

    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        name = self.megatron_param
        m = re.search(r"local_experts\.(\d+)\.", name)
        if m is None or re.search(r"\.(weight|bias)\d+$", name):
            return original(self, megatron_weights, megatron_module, hf_param_name)
        self.megatron_param = name + m.group(1)
        try:
            return original(self, megatron_weights, megatron_module, hf_param_name)
        finally:
            self.megatron_param = name

    gather_from_ep_ranks._relax_sequential = True
    pm.MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks


def mark_tensor_parallel(module) -> None:
    """Tag the TP-sharded parameters as megatron-core's initialisers do.

    megatron-core 0.16 sets `tensor_model_parallel` only inside its weight initialisers, which
    the bridge skips (`perform_initialization=False`: the HF weights are loaded instead).
    Untagged shards count as TP replicas: the grad norm (and so clipping) would then see only
    TP rank 0's shard of every split matrix.
    """
    from megatron.core.tensor_parallel import layers

    dims = {layers.ColumnParallelLinear: {"weight": 0, "bias": 0},
            layers.RowParallelLinear: {"weight": 1},
            layers.VocabParallelEmbedding: {"weight": 0}}
    for sub in module.modules():
        for cls, names in dims.items():
            if not isinstance(sub, cls):
                continue
            for name, dim in names.items():
                p = getattr(sub, name, None)
                if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel",
                                                                     False):
                    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


def _float16_module():
    from megatron.core.transformer.module import Float16Module

    return Float16Module
