"""The trainer's backend seam: what `trainer/main.py` asks of a model, whichever library trains it.

    backend = build_backend(cfg, device)       # trainer.backend: torch | megatron
    backend.data_ranks                         # rows of the batch each global rank gets
    metrics = backend.train_step(blocks)       # one optimizer step on this rank's rows
    backend.named_hf_weights()                 # HF names, full tensors (collective: all ranks)
    weights = backend.engine_weights(stream)   # what a sync sends (rank 0's; [] elsewhere)
    handle = backend.save(root, step, extra, ...)  /  extra = backend.load(path)
    backend.save_hf(out_dir)
    backend.eval_sums(block)                   # forward only: NLL sums (SFT validation)

The loop never branches on the backend (nor on the algorithm): the torch backend is a
transformers model under DDP/FSDP2 with torch DCP checkpoints; the megatron backend is
megatron-core (TP/PP/EP) built through megatron-bridge, with Megatron dist-checkpoints.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from relax_slurm.config import TrainConfig
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.export import sync_share

log = logging.getLogger("relax_slurm.trainer")


class TorchBackend:
    """transformers model, DDP or FSDP2 over all ranks (every rank is a data-parallel rank)."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        from relax_slurm.trainer.model import (
            build_optimizer, freeze_modules, load_hf_model, load_reference_model, pad_token_id,
            wrap_parallel,
        )

        self.cfg = cfg
        # the loss's typed parameters, once per run (the config is validated and fixed)
        self.estimator_params = cfg.algo.estimator_params()
        raw = load_hf_model(cfg.model, device, trained=True, recompute=cfg.trainer.recompute)
        self.lora = cfg.model.lora.enabled
        if self.lora:  # adapters on the frozen model.path (trainer/lora.py)
            from relax_slurm.trainer.lora import apply_lora, check_mergeable

            if not cfg.adapter_sync:
                check_mergeable(raw.config, cfg.model, "this run syncs merged weights (let the "
                                "engines serve the adapter: model.lora.sync=auto with "
                                "rollout=hf or sglang)")
            raw = apply_lora(raw, cfg.model)
            trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
            log.info("model.lora: rank %d adapters on %s, %d trainable parameters of %d",
                     cfg.model.lora.rank, cfg.model.lora.target_modules, trainable,
                     sum(p.numel() for p in raw.parameters()))
        if cfg.trainer.freeze_modules:
            log.info("froze %d parameters under %s",
                     freeze_modules(raw, cfg.trainer.freeze_modules), cfg.trainer.freeze_modules)
        self.pad_id = pad_token_id(raw.config)
        self.model = wrap_parallel(raw, cfg.trainer, device)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, cfg.trainer, cfg.model.lora.policy_lr(cfg.trainer.lr))
        # the KL loss's anchor: model.path as loaded, frozen (also on resume); with model.lora
        # the policy with its adapter off, which is model.path itself, without a second copy
        self.ref_model = None
        if cfg.algo.uses_reference and self.lora:
            from relax_slurm.trainer.lora import AdapterDisabled

            self.ref_model = AdapterDisabled(raw)
        elif cfg.algo.uses_reference:
            self.ref_model = load_reference_model(cfg.model, device)
        # algo=ppo: the value model, its own weights and optimizer (trainer/critic.py)
        self.critic = None
        if cfg.algo.uses_critic:
            from relax_slurm.trainer.critic import Critic

            self.critic = Critic(cfg, device)
        self.data_ranks = list(range(dist.get_world_size()))
        self.steps_done = 0  # rollout batches trained (a checkpoint's step after a resume)

    def train_step(self, blocks: Iterable[tuple[MicroBatch, bool]],
                   before_update: Callable[[], None] = lambda: None) -> dict[str, float]:
        from relax_slurm.trainer.step import train_step

        from relax_slurm.trainer.model import reference_due, refresh_reference

        t = self.cfg.trainer

        def policy_step(blocks) -> dict[str, float]:
            return train_step(
                self.model, self.optimizer, self.scheduler, blocks, self.cfg.algo,
                micro_batch_size=t.micro_batch_size, grad_clip=t.grad_clip,
                temperature=self.cfg.rollout.temperature, ref_model=self.ref_model,
                before_update=before_update, num_steps=t.num_steps_per_rollout,
                params=self.estimator_params, logprob_chunk_size=t.logprob_chunk_size)

        if self.critic is None:
            metrics = policy_step(blocks)
        else:  # GAE advantages from the critic's values before its step (critic_step.py)
            from relax_slurm.trainer.critic import reward_kl
            from relax_slurm.trainer.critic_step import train_with_critic

            kl = (reward_kl(self.cfg, self.model, self.ref_model) if self.cfg.algo.kl_coef
                  else None)
            metrics = train_with_critic(
                self.critic, blocks, kl, policy_step=policy_step,
                warming_up=self.steps_done < self.cfg.algo.critic_warmup_steps,
                skip_policy=lambda: self._skip_policy(before_update),
                num_steps=t.num_steps_per_rollout)
        self.steps_done += 1
        if reference_due(self.steps_done, self.cfg.algo.ref_update_interval):
            refresh_reference(self.ref_model, self.model)
            log.info("reference model refreshed from the policy after step %d", self.steps_done)
        return metrics

    def _skip_policy(self, before_update: Callable[[], None]) -> None:
        """A critic warmup batch: no policy step, but its lr schedule counts the batch."""
        before_update()
        with warnings.catch_warnings():  # deliberate: no policy optimizer step this batch
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    def release_step_memory(self) -> None:
        """Shared GPUs (rollout.release_memory_during_train): before the engines take their
        memory back, drop the step's gradients (every step starts by setting them to None
        anyway) and hand the allocator's cached blocks back to the GPU. Every rank."""
        from relax_slurm.trainer.model import release_cached_memory

        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.optimizer.zero_grad(set_to_none=True)
        release_cached_memory()

    def eval_sums(self, block: MicroBatch) -> dict[str, float]:
        """Forward only (SFT validation): this rank's summed NLL of its rows' trained tokens
        and their count. Collective under FSDP2: every rank calls it on an equal block."""
        from relax_slurm.trainer.step import nll_sums

        return nll_sums(self.model, block, self.cfg.trainer.micro_batch_size,
                        self.cfg.trainer.logprob_chunk_size)

    def named_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        from relax_slurm.trainer.model import DTYPES, full_named_weights

        return full_named_weights(self.model, DTYPES[self.cfg.model.dtype])

    def engine_weights(self, stream: bool = False):
        """What a weight sync sends: the HF-named full tensors (rank 0's share: sync_share), or
        with model.lora and engines that serve adapters (cfg.adapter_sync) the adapter alone
        (a weightsync Adapter)."""
        if self.lora and self.cfg.adapter_sync:
            from relax_slurm.trainer.lora import adapter_of
            from relax_slurm.trainer.model import DTYPES, unwrap

            return adapter_of(unwrap(self.model), DTYPES[self.cfg.model.dtype])
        fsdp2 = self.cfg.trainer.strategy == "fsdp2"
        named = self.named_hf_weights()
        if fsdp2 and not stream:  # an overlapped push's whole copy: host memory, not the GPU's
            named = ((n, t.cpu()) for n, t in named)
        return sync_share(named, dist.get_rank(), collective=fsdp2, stream=stream)

    def local_weights(self) -> Callable[[], list[tuple[str, Tensor]]] | None:
        """Rank 0's whole weights without a collective (DDP or one rank), for re-syncing a
        restarted engine between steps; None where gathering them needs every rank (FSDP2)."""
        if self.cfg.trainer.strategy == "ddp" or dist.get_world_size() == 1:
            return self.engine_weights
        return None

    def save(self, root: Path, step: int, extra: dict[str, Any], *, keep_last: int,
             async_save: bool, hf_assets_src: str | None):
        from relax_slurm.checkpoint import save_checkpoint

        if self.lora:  # the adapter's config and base beside the adapter's tensors
            from relax_slurm.trainer.lora import CHECKPOINT_KEY, checkpoint_record
            from relax_slurm.trainer.model import unwrap

            extra = {**extra, CHECKPOINT_KEY: checkpoint_record(unwrap(self.model),
                                                                self.cfg.model.path)}
        return save_checkpoint(root, step, self.model, self.optimizer, self.scheduler, extra,
                               keep_last=keep_last, async_save=async_save,
                               hf_assets_src=hf_assets_src, reference=self._moving_reference(),
                               critic=self._critic_state(), trainable_only=self.lora)

    def load(self, path: Path) -> dict[str, Any]:
        from relax_slurm.checkpoint import load_checkpoint

        extra = load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                reference=self._moving_reference(),
                                critic=self._critic_state(), trainable_only=self.lora)
        self.steps_done = extra["step"]
        return extra

    def _critic_state(self):
        """algo=ppo: the critic's (model, optimizer), checkpointed with the policy."""
        return None if self.critic is None else (self.critic.model, self.critic.optimizer)

    def _moving_reference(self):
        """The reference model when it is not model.path as loaded (it is then checkpointed)."""
        return self.ref_model if self.cfg.algo.ref_update_interval else None

    def save_hf(self, out_dir: Path) -> None:
        from relax_slurm.checkpoint import save_hf

        if self.lora:  # the merged model (relax-convert --to peft gives the adapter alone)
            from relax_slurm.checkpoint.hf_files import write_hf_dir
            from relax_slurm.trainer.lora import merged_parameters
            from relax_slurm.trainer.model import unwrap

            peft_model = unwrap(self.model)
            # under FSDP2 the merge gathers: the other ranks drive it and drop each tensor
            merged = sync_share(merged_parameters(peft_model), dist.get_rank(),
                                collective=self.cfg.trainer.strategy == "fsdp2")
            if dist.get_rank() == 0:
                base = peft_model.get_base_model()
                write_hf_dir(dict(merged), base.config, out_dir, self.cfg.model.path, None,
                             base, overwrite=True)
            return
        save_hf(self.model, self.cfg.model.path, out_dir)

    def close(self) -> None:
        pass


def build_backend(cfg: TrainConfig, device: torch.device):
    """The backend `trainer.backend` names (process groups already initialised)."""
    if cfg.trainer.backend == "megatron":
        from relax_slurm.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, device)
    return TorchBackend(cfg, device)
