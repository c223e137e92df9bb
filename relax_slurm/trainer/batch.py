"""From broker groups to per-rank tensors: advantages, loss weights, sharding, padding.

Rank 0 receives whole groups; advantages and loss weights need the whole batch, so they are
computed there, then the flat list of samples is cut into one equal shard per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relax_slurm.algos import compute_advantages, reduction_weights
from relax_slurm.config.schema import AlgoConfig
from relax_slurm.samples import Group, Sample


@dataclass
class TrainItem:
    """One sample with what the loss needs beyond the sample itself."""

    sample: Sample
    advantage: float
    weights: np.ndarray
    """Per response token loss weight (reduction folded in), [R] float32."""


def algo_params(algo: AlgoConfig) -> dict:
    """The algorithm's knobs as keyword arguments (each function takes the ones it needs)."""
    params = dataclasses.asdict(algo)
    params.pop("name")
    return params


def prepare_items(groups: list[Group], algo: AlgoConfig) -> list[TrainItem]:
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [B, G]
    adv = compute_advantages(algo.name, rewards, **algo_params(algo)).flatten()  # [B*G]
    reduction = algo.loss_reduction
    samples = [s for g in groups for s in g]
    masks = [torch.from_numpy(s.loss_mask) for s in samples]
    weights = reduction_weights(masks, reduction)
    return [
        TrainItem(sample=s, advantage=float(a), weights=w.numpy())
        for s, a, w in zip(samples, adv.tolist(), weights)
    ]


def shard(items: list[TrainItem], world_size: int) -> list[list[TrainItem]]:
    """Equal contiguous shards; the config check guarantees divisibility."""
    per = len(items) // world_size
    assert per * world_size == len(items), "batch not divisible by trainer ranks"
    return [items[r * per:(r + 1) * per] for r in range(world_size)]


@dataclass
class MicroBatch:
    input_ids: Tensor       # [B, T] prompt + response, right-padded
    attention_mask: Tensor  # [B, T]
    targets: Tensor         # [B, T-1] input_ids shifted left: token predicted at each position
    weights: Tensor         # [B, T-1] loss weight of each predicted token (0 off-response)
    advantages: Tensor      # [B, T-1]
    rollout_logp: Tensor    # [B, T-1]
    teacher_logp: Tensor | None = None  # [B, T-1], when the samples carry teacher log-probs


def collate(items: list[TrainItem], pad_id: int, device: torch.device) -> MicroBatch:
    lengths = [len(it.sample.prompt_ids) + it.sample.response_len for it in items]
    B, T = len(items), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    weights = torch.zeros((B, T - 1))
    adv = torch.zeros((B, T - 1))
    rollout_logp = torch.zeros((B, T - 1))
    with_teacher = [it.sample.teacher_logprobs is not None for it in items]
    if any(with_teacher) and not all(with_teacher):
        raise ValueError(f"{sum(with_teacher)} of {len(items)} samples carry teacher log-probs: "
                         "a batch needs them on every sample or none")
    teacher_logp = torch.zeros((B, T - 1)) if all(with_teacher) else None
    for i, it in enumerate(items):
        s = it.sample
        P, R = len(s.prompt_ids), s.response_len
        input_ids[i, :P] = torch.from_numpy(s.prompt_ids)
        input_ids[i, P:P + R] = torch.from_numpy(s.response_ids)
        attention[i, :P + R] = 1
        # response token j sits at position P+j and is predicted by the logits at P+j-1
        span = slice(P - 1, P - 1 + R)
        weights[i, span] = torch.from_numpy(it.weights)
        adv[i, span] = it.advantage
        rollout_logp[i, span] = torch.from_numpy(s.rollout_logprobs)
        if teacher_logp is not None:
            teacher_logp[i, span] = torch.from_numpy(s.teacher_logprobs)
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        targets=input_ids[:, 1:].to(device),
        weights=weights.to(device),
        advantages=adv.to(device),
        rollout_logp=rollout_logp.to(device),
        teacher_logp=None if teacher_logp is None else teacher_logp.to(device),
    )
