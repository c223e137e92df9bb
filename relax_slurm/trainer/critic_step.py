"""One rollout batch with a critic (algo=ppo), for either trainer backend.

    blocks = critic.prepare(blocks, reward_kl)   # values -> GAE -> whitened advantages
    metrics = train_with_critic(critic, blocks, reward_kl, warming_up=..., policy_step=...,
                                skip_policy=..., num_steps=...)

Both backends own a critic with the same two calls (`Critic`: `prepare`, `update`); the order
of a step (the critic's values before any update, the policy's step(s), then the critic's) and
the GAE on the values live here once, so neither backend restates them. What differs is how a
backend computes values and steps its optimizer (trainer/critic.py: transformers under DDP or
FSDP2; trainer/megatron/critic.py: megatron-core's schedule) and over which ranks the batch's
whitening moments are summed (every rank holding distinct rows: all ranks under torch, the
data-parallel group under megatron, whose TP peers hold the same rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from relax_slurm.algos.ppo import gae, token_rewards, whiten
from relax_slurm.config import TrainConfig
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.trainer.batch import MicroBatch

Blocks = list[tuple[MicroBatch, bool]]
RewardKL = Callable[[MicroBatch], Tensor]
"""A block's per-token KL of the sampling-time policy to the reference, [rows, T-1]."""


class Critic(Protocol):
    def prepare(self, blocks: Iterable[tuple[MicroBatch, bool]],
                reward_kl: RewardKL | None) -> Blocks:
        """This rank's blocks with GAE advantages, `old_values` and `returns`."""

    def update(self, blocks: Blocks, num_steps: int) -> dict[str, float]:
        """The clipped value loss, one optimizer step per mini-batch; `critic/*` metrics."""


def train_with_critic(critic: Critic, blocks: Iterable[tuple[MicroBatch, bool]],
                      reward_kl: RewardKL | None, *, warming_up: bool,
                      policy_step: Callable[[Blocks], dict[str, float]],
                      skip_policy: Callable[[], None], num_steps: int) -> dict[str, float]:
    """The critic's values (before its update) give the advantages; the policy steps on them
    (or, in the first algo.critic_warmup_steps batches, `skip_policy` only moves its lr
    schedule); then the critic steps, on the same mini-batches."""
    blocks = critic.prepare(blocks, reward_kl)
    if warming_up:  # the critic learns alone; the policy's weights and optimizer stay
        skip_policy()
        metrics = {"train/critic_warmup": 1.0}
    else:
        metrics = policy_step(blocks)
    return metrics | critic.update(blocks, num_steps)


def with_gae(block: MicroBatch, values: Tensor, kl: Tensor | None, algo: AlgoConfig,
             reduce: Callable[[Tensor], Tensor]) -> MicroBatch:
    """The block with GAE advantages whitened over the whole batch (`reduce` sums the moments
    over the ranks holding the rest of it), `old_values` and `returns`. The incoming advantages
    are each sample's score on its trained tokens (algo=ppo's estimator passes it through);
    with algo.kl_coef the token rewards also carry `kl`."""
    mask = block.weights
    rewards = token_rewards(block.advantages, mask, kl, algo.kl_coef)
    adv, returns = gae(rewards, values, mask, algo.gamma, algo.lam)
    return dataclasses.replace(block, advantages=whiten(adv, mask, reduce=reduce),
                               old_values=values, returns=returns)


def critic_lr(cfg: TrainConfig) -> float:
    """algo.critic_lr, or 5 x trainer.lr: the value head regresses returns from a fresh start
    (tiny task, four PPO steps per batch: 1x trailed, reward 0.63 at step 100; 10x was noisy,
    0.80; 5x 0.93)."""
    return cfg.algo.critic_lr if cfg.algo.critic_lr is not None else 5 * cfg.trainer.lr


SUM_KEYS = ("vf_loss", "vf_clipped", "values", "returns", "tokens")


def add_sums(sums: dict[str, Tensor], loss: Tensor, clipped: Tensor, mb: MicroBatch) -> None:
    """A micro-batch's per-token value loss, clip flags, values and returns summed over its
    trained tokens into `sums` (float64 device tensors: no host sync per micro-batch)."""
    m = (mb.weights != 0).float()
    for key, per_token in (("vf_loss", loss.detach()), ("vf_clipped", clipped),
                           ("values", mb.old_values), ("returns", mb.returns),
                           ("tokens", 1.0)):
        sums[key] = sums[key] + (per_token * m).sum().double()


def zero_sums(device: torch.device) -> dict[str, Tensor]:
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return dict.fromkeys(SUM_KEYS, zero)


def reduce_sums(sums: dict[str, Tensor]) -> dict[str, float]:
    """Every rank's sums added (one all-reduce, one read to the host), divided by the trained
    tokens. Ranks that hold a copy of another's rows (megatron's TP peers) pass zeros."""
    keys = sorted(sums)
    stacked = torch.stack([sums[k] for k in keys])
    dist.all_reduce(stacked)
    total = dict(zip(keys, stacked.tolist()))
    tokens = max(total["tokens"], 1.0)
    return {"critic/vf_loss": total["vf_loss"] / tokens,
            "critic/vf_clipfrac": total["vf_clipped"] / tokens,
            "critic/values_mean": total["values"] / tokens,
            "critic/returns_mean": total["returns"] / tokens}
