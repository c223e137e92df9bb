"""The KL reference under trainer=megatron: a frozen megatron model, sharded as the policy.

    ref = MegatronReference(mm, cfg.model)          # the policy's bridge and provider: model.path
    batch = ref.with_logprobs(mm, batch, num_steps, micro_batch_size, temperature)
    ref.refresh(mm)                                  # algo.ref_update_interval: the policy's shards
    ref.sharded_state_dict() / ref.load(state)       # in the policy's dist-checkpoint (PREFIX)

It was a whole transformers replica on every rank, computing the whole vocabulary's logits: a
30B MoE's reference does not fit beside a GPU's shard of the policy. Built here by the same
bridge and provider as the policy (megatron/model.py provide_chunks), its chunks hold each
rank's TP/PP/EP shards of model.path, with no gradient buffer, no optimizer state and no DDP.
Its log-probs come from Megatron's forward-only schedule over the micro-batches the update runs
(step.forward_logprobs, as the policy's old log-probs): each TP rank's vocabulary slice, every
pipeline stage, context-parallel chunks; they reach the loss as `MicroBatch.ref_logp`. A
refresh copies each rank's policy shards into its own (no gather); right after one the KL is
exactly 0 (the same kernels on the same weights). Its MoE routers route on their own (the
rollout's routing is the policy's to replay), as the transformers replica's did.

With model.lora the reference stays the policy with its adapters off (megatron/lora.py
AdapterDisabled): no second copy at all.
"""

from __future__ import annotations

import torch

from relax_slurm.config.model import ModelConfig
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.megatron.model import DTYPES, MegatronModel, provide_chunks
from relax_slurm.trainer.megatron.step import forward_logprobs

PREFIX = "reference."
"""Its tensors' keys in the policy's dist-checkpoint: the policy's keys with this prefix (as the
critic's "critic."), so it reshards on load like the policy."""


class MegatronReference:
    def __init__(self, mm: MegatronModel, model_cfg: ModelConfig) -> None:
        self.chunks, _ = provide_chunks(mm.bridge, model_cfg, mm.cfg, DTYPES[model_cfg.dtype])
        for chunk in self.chunks:
            chunk.requires_grad_(False)

    def with_logprobs(self, mm: MegatronModel, batch: MicroBatch, num_steps: int,
                      micro_batch_size: int, temperature: float) -> MicroBatch:
        """The rows with `ref_logp` [rows, T-1] (on the last pipeline stage; every TP rank of
        it), from the micro-batches the update will run. Collective over the model-parallel
        groups: every rank calls it."""
        import dataclasses

        logp = forward_logprobs(mm, self.chunks, batch, None, num_steps, micro_batch_size,
                                temperature)
        return dataclasses.replace(batch, ref_logp=logp)

    @torch.no_grad()
    def refresh(self, mm: MegatronModel) -> None:
        """The policy's current weights in: each rank copies its own shards (the layouts are
        the same), parameters and buffers (an MoE router's expert bias moves in training)."""
        for mine, policy in zip(self.chunks, mm.chunks):
            policy = policy.module  # Megatron DDP's
            theirs = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
            for name, t in (*mine.named_parameters(), *mine.named_buffers()):
                t.copy_(theirs[name])

    def sharded_state_dict(self) -> dict:
        """Its chunks' megatron-core sharded state dicts, keys prefixed with PREFIX: one dict
        ("model") or one per virtual pipeline stage ("model0", ...), as the policy's."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        from relax_slurm.trainer.megatron.checkpoint import model_sharded_state_dict

        sds = model_sharded_state_dict(self.chunks)
        for sd in sds.values():
            replace_prefix_for_sharding(sd, "", PREFIX)
        return sds

    def load(self, state: dict) -> None:
        """The loaded `sharded_state_dict()` back into the chunks."""
        for i, chunk in enumerate(self.chunks):
            bare = getattr(chunk, "module", chunk)  # Float16Module's, in bf16 / fp16
            bare.load_state_dict(state["model" if len(self.chunks) == 1 else f"model{i}"])
