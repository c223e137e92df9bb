"""`trainer.backend=megatron` behind the trainer's backend seam (see trainer/backend.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from relax_slurm.config import TrainConfig
from relax_slurm.trainer.model import reference_due
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.export import sync_share
from relax_slurm.trainer.megatron import checkpoint, vl
from relax_slurm.trainer.megatron import lora as megatron_lora
from relax_slurm.trainer.megatron.model import (
    MegatronModel, data_ranks, destroy_model_parallel, init_model_parallel,
)
from relax_slurm.trainer.megatron.reference import MegatronReference
from relax_slurm.trainer.megatron.step import train_step

log = logging.getLogger("relax_slurm.trainer")


class MegatronBackend:
    """megatron-core model + optimizer; TP/PP peers share their data-parallel rank's rows."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg = cfg
        # the loss's typed parameters, once per run (the config is validated and fixed)
        self.estimator_params = cfg.algo.estimator_params()
        init_model_parallel(cfg.trainer)
        # model.lora: megatron-bridge's adapters on the frozen model (megatron/lora.py), put on
        # the bare chunks so that Megatron DDP and the optimizer hold the adapters only, at
        # model.lora.lr
        self.lora, self.peft = cfg.model.lora.enabled, None
        trainer_cfg, adapt = cfg.trainer, None
        if self.lora:
            trainer_cfg = dataclasses.replace(
                cfg.trainer, lr=cfg.model.lora.policy_lr(cfg.trainer.lr))

            def adapt(bare: list) -> None:
                self.peft = megatron_lora.apply_lora(bare, cfg.model)

        self.mm = MegatronModel(cfg.model, trainer_cfg, adapt=adapt)
        hf_config = self.mm.bridge.hf_pretrained.config
        if self.mm.vl is not None:  # before step 1: the model's kind is known only now
            vl.check_media(self.mm.vl, cfg.data.media_kinds)
        if self.lora:
            self._check_lora(hf_config)
        # multimodal configs keep it in the text config (transformers 5)
        pad = hf_config.get_text_config().pad_token_id
        self.pad_id = pad if pad is not None else 0
        # the KL loss's anchor: model.path as a frozen megatron model sharded as the policy
        # (megatron/reference.py); with model.lora the policy with its adapters off, which is
        # model.path itself
        self.ref_model = None
        if cfg.algo.uses_reference and self.lora:
            self.ref_model = megatron_lora.AdapterDisabled(self.peft)
        elif cfg.algo.uses_reference:
            self.ref_model = MegatronReference(self.mm, cfg.model)
        # algo=ppo: the value model, its own weights and optimizer (megatron/critic.py)
        self.critic = None
        if cfg.algo.uses_critic:
            from relax_slurm.trainer.megatron.critic import MegatronCritic

            self.critic = MegatronCritic(cfg, self.mm.bridge)
        self.data_ranks = data_ranks()

    def _check_lora(self, hf_config) -> None:
        """What model.lora under trainer=megatron cannot do yet, known once the model is."""
        from relax_slurm.errors import ConfigError

        if self.mm.vl is not None:
            raise ConfigError(
                "model.lora with trainer=megatron and a vision-language model is not tested "
                "(docs/lora.md#status): use trainer=torch, or model.lora.rank=0")
        if not self.cfg.adapter_sync:
            megatron_lora.check_mergeable(
                hf_config, self.cfg.model, "this run syncs merged weights (let the engines "
                "serve the adapter: model.lora.sync=auto with rollout=hf or sglang)")
        if self.cfg.trainer.save_hf_every:
            megatron_lora.check_mergeable(
                hf_config, self.cfg.model, f"trainer.save_hf_every="
                f"{self.cfg.trainer.save_hf_every} writes merged HF weights (set it to 0)")
        named = [p for c in self.mm.chunks for p in c.module.parameters()]
        if dist.get_rank() == 0:
            log.info("model.lora: rank %d adapters on %s, %d trainable parameters of %d on "
                     "rank 0 (its TP shards)", self.cfg.model.lora.rank,
                     self.cfg.model.lora.target_modules,
                     sum(p.numel() for p in named if p.requires_grad),
                     sum(p.numel() for p in named))

    def train_step(self, blocks: Iterable[tuple[MicroBatch, bool]],
                   before_update: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Whole batches only (one block): see TrainConfig.streaming_blockers for why."""
        [(batch, _)] = list(blocks)
        t = self.cfg.trainer
        warming_up = (self.critic is not None
                      and self.mm.steps_done < self.cfg.algo.critic_warmup_steps)
        # the whole batch's, before the step: the rows carry them (MicroBatch.ref_logp) to the
        # loss and the reward-side KL; a critic warmup batch trains no policy (no KL loss)
        if self.ref_model is not None and (not warming_up or self.cfg.algo.kl_coef):
            batch = self.ref_model.with_logprobs(self.mm, batch, t.num_steps_per_rollout,
                                                 t.micro_batch_size, self.cfg.rollout.temperature)

        def policy_step(blocks) -> dict[str, float]:
            [(batch, _)] = blocks
            return train_step(self.mm, batch, self.cfg.algo,
                              micro_batch_size=t.micro_batch_size,
                              temperature=self.cfg.rollout.temperature,
                              before_update=before_update,
                              num_steps=t.num_steps_per_rollout,
                              params=self.estimator_params)

        if self.critic is None:
            metrics = policy_step([(batch, True)])
        else:  # GAE advantages from the critic's values before its step (critic_step.py)
            from relax_slurm.trainer.critic_step import train_with_critic
            from relax_slurm.trainer.megatron.critic import reward_kl

            kl = reward_kl(self.cfg, self.mm) if self.cfg.algo.kl_coef else None
            metrics = train_with_critic(
                self.critic, [(batch, True)], kl, policy_step=policy_step,
                warming_up=warming_up,
                skip_policy=lambda: self._skip_policy(before_update),
                num_steps=t.num_steps_per_rollout)
        if reference_due(self.mm.steps_done, self.cfg.algo.ref_update_interval):
            self.refresh_reference()
        return metrics

    def _skip_policy(self, before_update: Callable[[], None]) -> None:
        """A critic warmup batch: no policy step, but its lr schedule counts the batch."""
        before_update()
        self.mm.steps_done += 1

    def refresh_reference(self) -> None:
        """The policy's weights into the reference (algo.ref_update_interval): each rank copies
        its own shards (megatron/reference.py)."""
        self.ref_model.refresh(self.mm)
        if dist.get_rank() == 0:  # every rank refreshes its shards; one line says so
            log.info("reference model refreshed from the policy after step %d",
                     self.mm.steps_done)

    def release_step_memory(self) -> None:
        """Shared GPUs: the allocator's cached blocks back to the GPU before the engines wake
        (megatron-core's gradient buffers are persistent: they stay)."""
        from relax_slurm.trainer.model import release_cached_memory

        release_cached_memory()

    def eval_sums(self, block: MicroBatch) -> dict[str, float]:
        """Forward only (SFT validation): NLL sums of this rank's share (see
        megatron.step.eval_sums); every rank calls it."""
        from relax_slurm.trainer.megatron.step import eval_sums

        return eval_sums(self.mm, block, micro_batch_size=self.cfg.trainer.micro_batch_size)

    def named_hf_weights(self, cpu: bool = True) -> Iterator[tuple[str, Tensor]]:
        """The bridge's export: every rank drives it (gathers across TP/PP/EP)."""
        return self.mm.named_hf_weights(cpu=cpu)

    def engine_weights(self, stream: bool = False):
        """What a weight sync sends: the HF-named full tensors (with model.lora the bridge's
        export merges the adapters in), or with model.lora and engines that serve adapters
        (cfg.adapter_sync) the adapter alone under PEFT's names (a weightsync Adapter; every
        rank drives the TP gather and gets it)."""
        if self.lora and self.cfg.adapter_sync:
            from relax_slurm.trainer.model import DTYPES

            return megatron_lora.adapter_of(self.mm.bridge, self.mm.chunks, self.cfg.model,
                                            DTYPES[self.cfg.model.dtype])
        # streamed, each tensor is sent from where it was gathered (on GPUs: no round trip
        # through host memory); a whole copy is kept in host memory
        return sync_share(self.named_hf_weights(cpu=not stream), dist.get_rank(),
                          collective=True, stream=stream)

    def local_weights(self) -> None:
        """Exporting HF weights gathers over TP/PP/EP (a collective): a restarted engine
        gets them with the next step's sync."""
        return None

    def save(self, root: Path, step: int, extra: dict[str, Any], *, keep_last: int,
             async_save: bool, hf_assets_src: str | None):
        if self.lora:  # the adapter's config and base beside its tensors (as trainer=torch)
            extra = {**extra, megatron_lora.CHECKPOINT_KEY: megatron_lora.checkpoint_record(
                self.cfg.model)}
        return checkpoint.save(root, step, self.mm, extra, keep_last=keep_last,
                               hf_assets_src=hf_assets_src, async_save=async_save,
                               reference=self._moving_reference(), critic=self._critic(),
                               adapter_only=self.lora)

    def load(self, path: Path) -> dict[str, Any]:
        return checkpoint.load(path, self.mm, reference=self._moving_reference(),
                               critic=self._critic(), adapter_only=self.lora)

    def _critic(self) -> MegatronModel | None:
        """algo=ppo: the critic's model and optimizer, checkpointed with the policy."""
        return None if self.critic is None else self.critic.mm

    def _moving_reference(self):
        """The reference model when it is not model.path as loaded (it is then checkpointed)."""
        return self.ref_model if self.cfg.algo.ref_update_interval else None

    def save_hf(self, out_dir: Path) -> None:
        checkpoint.save_hf(self.mm, self.cfg.model.path, out_dir)

    def close(self) -> None:
        destroy_model_parallel()
