"""The critic of algo=ppo on the torch backend: a value model beside the policy.

    critic = Critic(cfg, device)              # model.path's transformer + a fresh scalar head
    blocks = critic.prepare(blocks, reward_kl)  # values, GAE, whitened advantages, returns
    ... the policy's train_step on those blocks ...
    metrics = critic.update(blocks, ...)      # the clipped value loss, one AdamW step each

Its weights are its own (model.path's decoder loaded once more, the LM head dropped, a linear
value head initialised to 0, so the first values are 0 and nothing draws from the RNG), under
the same DDP / FSDP2 wrapping as the policy, with its own optimizer (`algo.critic_lr`,
constant). `prepare` runs before the policy's step: the values are the critic's before its
update, as the advantages and the value clip need. The order of a step and the GAE are shared
with the megatron critic (trainer/critic_step.py); the math is `relax_slurm.algos.ppo`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relax_slurm.algos.common import kl_penalty
from relax_slurm.algos.ppo import value_loss
from relax_slurm.config import TrainConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.critic_step import (
    Blocks, RewardKL, add_sums, critic_lr, reduce_sums, with_gae, zero_sums,
)


class ValueModel(nn.Module):
    """A causal LM's decoder with a scalar head: one value per position, [B, T]."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        if not isinstance(getattr(lm, "model", None), nn.Module):
            raise ConfigError(f"algo=ppo builds its critic from {type(lm).__name__}'s decoder "
                              "`.model`, which this class does not have: use a model whose "
                              "causal LM keeps its decoder as `.model` (Qwen, Llama, Mistral, ...)")
        self.model = lm.model  # the decoder (FSDP2 shards model.layers, as for the policy)
        self.config = lm.config
        text = getattr(lm.config, "text_config", None) or lm.config
        weight = lm.get_output_embeddings().weight
        self.value_head = nn.Linear(text.hidden_size, 1, dtype=weight.dtype,
                                    device=weight.device)
        with torch.no_grad():  # V = 0 until trained; no RNG drawn (runs stay reproducible)
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    def forward(self, **inputs: Tensor) -> Tensor:
        hidden = self.model(**inputs).last_hidden_state  # [B, T, H]
        # a new tensor, not a view: FSDP2 warns that a view returned by its module would lose
        # its pre-backward hook under an in-place op
        return self.value_head(hidden).squeeze(-1).float().clone()


class Critic:
    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        from relax_slurm.trainer.model import load_hf_model, wrap_parallel

        self.cfg = cfg
        value = ValueModel(load_hf_model(cfg.model, device, trained=True,
                                         recompute=cfg.trainer.recompute))
        self.model = wrap_parallel(value, cfg.trainer, device)
        t = cfg.trainer
        self.lr = critic_lr(cfg)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, weight_decay=t.weight_decay,
            betas=(t.adam_beta1, t.adam_beta2))

    def _values(self, mb: MicroBatch) -> Tensor:
        """V at every position predicting a token, [B, T-1] (aligned with `mb.targets`)."""
        return self.model(**mb.forward_kwargs())[:, :-1]

    def _block_values(self, block: MicroBatch) -> Tensor:
        """V over the block, [rows, T-1], in micro-batches (each cut to its longest row)."""
        values = torch.zeros_like(block.weights)
        size = self.cfg.trainer.micro_batch_size
        for lo in range(0, len(block), size):
            mb = block.rows(lo, lo + size)
            values[lo:lo + len(mb), :mb.targets.shape[1]] = self._values(mb)
        return values

    @torch.no_grad()
    def prepare(self, blocks: Iterable[tuple[MicroBatch, bool]],
                reward_kl: RewardKL | None) -> Blocks:
        """This rank's blocks with GAE advantages whitened over the whole batch (every rank's
        trained tokens: a collective), `old_values` and `returns` (critic_step.with_gae);
        `reward_kl` (algo.kl_coef) gives the token rewards' KL."""
        [(block, last)] = list(blocks)  # whole batches (streaming is refused for algo=ppo)
        self.model.train()  # the mode its update runs in (from_pretrained leaves eval)
        values = self._block_values(block)
        kl = reward_kl(block) if reward_kl is not None else None
        return [(with_gae(block, values, kl, self.cfg.algo, _all_reduce), last)]

    def update(self, blocks: Blocks, num_steps: int) -> dict[str, float]:
        """The clipped value loss over this rank's rows (weighted like the policy's loss: the
        batch's weights sum to 1 over ranks), in `num_steps` mini-batches with one optimizer
        step each; metrics `critic/*` (per trained token, over every rank)."""
        from relax_slurm.trainer.step import mini_batches

        self.model.train()
        [(block, _)] = blocks
        world = dist.get_world_size()
        # device tensors, read once in reduce_sums: no host sync per micro-batch (float64, so the
        # sums are those of adding each micro-batch's float32 sum as a Python float)
        sums = zero_sums(block.weights.device)
        norms = []
        for _, mini in mini_batches(block, num_steps):
            self.optimizer.zero_grad(set_to_none=True)
            self._accumulate(mini, sums, scale=world * num_steps)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  self.cfg.trainer.grad_clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            self.optimizer.step()
        return reduce_sums(sums) | {"critic/grad_norm": sum(norms) / len(norms),
                                "critic/lr": self.lr}

    def _accumulate(self, mini: MicroBatch, sums: dict[str, Tensor], scale: float) -> None:
        size = self.cfg.trainer.micro_batch_size
        mbs = [mini.rows(lo, lo + size) for lo in range(0, len(mini), size)]
        for i, mb in enumerate(mbs):
            # DDP: all-reduce the critic's gradients once, on the last micro-batch
            sync = (contextlib.nullcontext() if i == len(mbs) - 1
                    or not hasattr(self.model, "no_sync") else self.model.no_sync())
            with sync:
                values = self._values(mb)  # [B, T-1]
                loss, clipped = value_loss(values, mb.old_values, mb.returns,
                                           self.cfg.algo.value_clip)
                (((loss * mb.weights).sum()) * scale).backward()
            add_sums(sums, loss, clipped, mb)


def reward_kl(cfg: TrainConfig, policy: nn.Module, ref: nn.Module) -> RewardKL:
    """Per-token KL of the sampling-time policy to the reference, [rows, T-1]
    (algo.kl_loss_type; the policy's own log-probs before the step with
    old_logprobs=recompute, the engine's with rollout), as the loss's reward-side KL."""
    from relax_slurm.trainer.step import token_logprobs

    algo, temp, chunk = cfg.algo, cfg.rollout.temperature, cfg.trainer.logprob_chunk_size

    @torch.no_grad()
    def block_kl(block: MicroBatch) -> Tensor:
        kl = torch.zeros_like(block.weights)
        size = cfg.trainer.micro_batch_size
        for lo in range(0, len(block), size):
            mb = block.rows(lo, lo + size)
            old = (mb.rollout_logp if algo.old_logprobs == "rollout"
                   else token_logprobs(policy, mb, temp, chunk))
            kl[lo:lo + len(mb), :mb.targets.shape[1]] = kl_penalty(
                old, token_logprobs(ref, mb, temp, chunk), algo.kl_loss_type)
        return kl

    return block_kl


def _all_reduce(t: Tensor) -> Tensor:
    dist.all_reduce(t)
    return t
