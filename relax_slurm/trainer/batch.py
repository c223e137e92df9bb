"""From broker groups to per-rank tensors: advantages, loss weights, sharding, padding.

Rank 0 receives whole groups; advantages and loss weights need the whole batch, so they are
computed there, the whole batch is collated into padded tensors, and each rank receives an
equal block of rows (`scatter_batch`: tensors on the wire, no pickling of samples). The train
step cuts its block into micro-batches with `MicroBatch.rows`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from relax_slurm.algos import compute_advantages, reduction_weights
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.algo_params import EstimatorParams
from relax_slurm.samples import Group, Sample


@dataclass
class TrainItem:
    """One sample with what the loss needs beyond the sample itself."""

    sample: Sample
    advantage: float
    weights: np.ndarray
    """Per response token loss weight (reduction folded in), [R] float32."""


# the `algo.*` fields `policy_loss` takes as keywords of its own (the estimator's parameters
# go typed, as `params`; the reduction is folded into the per-token weights over the whole
# batch and old_logprobs picks the ratio's denominator, so neither goes in);
# tests/unit/trainer/test_batch.py keeps this list equal to policy_loss's signature
LOSS_KNOBS = ("tis_clip", "tis_type", "tis_clip_low", "opsm_delta", "entropy_coef",
              "kl_loss_coef", "kl_loss_type", "kl_coef", "opd_kl_coef", "opd_only_reward")


def loss_params(algo: AlgoConfig, params: EstimatorParams | None = None) -> dict:
    """`policy_loss`'s keywords for `algo`: its knobs and the estimator's typed `params`
    (the caller's, built once per run; built here without)."""
    return {**{k: getattr(algo, k) for k in LOSS_KNOBS},
            "params": algo.estimator_params() if params is None else params}


def prepare_items(groups: list[Group], algo: AlgoConfig, batch_samples: int | None = None,
                  params: EstimatorParams | None = None) -> list[TrainItem]:
    """The groups' samples with advantages and loss weights; `batch_samples`: the step's
    sample count when `groups` are only part of its batch (streaming, trainer/stream.py);
    `params`: `algo.estimator_params()` when the caller keeps it (built here without)."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [B, G]
    if params is None:
        params = algo.estimator_params()
    adv = compute_advantages(algo.name, rewards, params).flatten()  # [B*G]
    reduction = algo.loss_reduction
    samples = [s for g in groups for s in g]
    masks = [torch.from_numpy(s.loss_mask) for s in samples]
    weights = reduction_weights(masks, reduction, batch_samples)
    return [
        TrainItem(sample=s, advantage=float(a), weights=w.numpy())
        for s, a, w in zip(samples, adv.tolist(), weights)
    ]


@dataclass
class MediaTensors:
    """The processed media of a block of rows: forward kwargs, rows' items concatenated."""

    tensors: dict[str, Tensor]
    """name -> [sum of the rows' items, ...] (pixel_values [N, D], image_grid_thw [n, 3], ...)."""
    counts: dict[str, tuple[int, ...]]
    """name -> each row's number of items along dim 0, in row order."""

    def rows(self, lo: int, hi: int) -> "MediaTensors":
        out = {}
        for name, t in self.tensors.items():
            c = self.counts[name]
            start = sum(c[:lo])
            out[name] = t[start:start + sum(c[lo:hi])]
        return MediaTensors(tensors=out, counts={k: c[lo:hi] for k, c in self.counts.items()})

    def kwargs(self) -> dict[str, Tensor]:
        """What the forward takes: names with no item in these rows are left out."""
        return {k: t for k, t in self.tensors.items() if t.shape[0] > 0}


def collate_media(items: list[TrainItem]) -> MediaTensors | None:
    """Every sample's `mm_inputs` concatenated per name in row order (numpy -> torch once)."""
    names = sorted({k for it in items for k in it.sample.mm_inputs})
    if not names:
        return None
    tensors, counts = {}, {}
    for name in names:
        arrays = [it.sample.mm_inputs.get(name) for it in items]
        like = next(a for a in arrays if a is not None)
        arrays = [a if a is not None else np.empty((0, *like.shape[1:]), like.dtype)
                  for a in arrays]
        tensors[name] = torch.from_numpy(np.concatenate(arrays))
        counts[name] = tuple(len(a) for a in arrays)
    return MediaTensors(tensors=tensors, counts=counts)


@dataclass
class MicroBatch:
    input_ids: Tensor       # [B, T] prompt + response, right-padded
    attention_mask: Tensor  # [B, T]
    targets: Tensor         # [B, T-1] input_ids shifted left: token predicted at each position
    weights: Tensor         # [B, T-1] loss weight of each predicted token (0 off-response)
    advantages: Tensor      # [B, T-1]
    rollout_logp: Tensor    # [B, T-1]
    teacher_logp: Tensor | None = None  # [B, T-1], when the samples carry teacher log-probs
    old_logp: Tensor | None = None
    """[B, T-1]: the policy's log-probs before the step's first optimizer step, set by the
    trainer when one rollout batch takes several (trainer.num_steps_per_rollout); None: the
    ratio's denominator is the micro-batch's own detached log-probs."""
    ref_logp: Tensor | None = None
    """[B, T-1]: the KL reference's log-probs, when the backend computes them for the whole
    batch before the step (trainer=megatron's sharded reference: megatron/reference.py);
    None: the loss asks the reference model per micro-batch (trainer.step.reference_logprobs)."""
    old_values: Tensor | None = None
    """[B, T-1]: the critic's values before its update (algo=ppo; set on each rank)."""
    returns: Tensor | None = None
    """[B, T-1]: the GAE returns the critic is trained on (algo=ppo; set on each rank)."""
    # prompt + response length of each row, on the host: cutting micro-batches to their longest
    # row then needs no device->host copy (a GPU sync) per micro-batch
    seq_lens: tuple[int, ...] = ()
    media: MediaTensors | None = None
    """Processed images/audio of the rows (multimodal models), or None."""
    routed: Tensor | None = None
    """MoE models: the rollout's expert ids at every position, [B, T, layers x top-k] int32
    (valid below each row's length - 1), when the samples carry them."""

    def routed_valid(self) -> Tensor:
        """[B, T] bool: the positions `routed` covers: all but each row's last token, except
        rows of NOT_ROUTED ids (-1: a multi-turn sample's positions no turn's report covered,
        relax_slurm.routing.segments), which are neither compared nor replayed."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        lens = torch.tensor(self.seq_lens, device=self.input_ids.device)
        valid = pos[None, :] < (lens[:, None] - 1)
        if self.routed is not None:  # a covered row holds expert ids >= 0 in its MoE layers
            valid = valid & (self.routed >= 0).any(dim=-1)
        return valid

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def forward_kwargs(self) -> dict[str, Tensor]:
        """The model's inputs: ids, mask and, for multimodal rows, their media tensors."""
        media = self.media.kwargs() if self.media is not None else {}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **media}

    def rows(self, lo: int, hi: int) -> "MicroBatch":
        """Rows lo..hi-1, cut to their longest sequence (a block is padded to the batch's)."""
        width = max((*self.seq_lens[lo:hi], 2))
        return MicroBatch(
            input_ids=self.input_ids[lo:hi, :width],
            attention_mask=self.attention_mask[lo:hi, :width],
            targets=self.targets[lo:hi, :width - 1],
            **{name: None if t is None else t[lo:hi, :width - 1]
               for name, t in ((f, getattr(self, f)) for f in _PER_POSITION)},
            seq_lens=self.seq_lens[lo:hi],
            media=None if self.media is None else self.media.rows(lo, hi),
            routed=None if self.routed is None else self.routed[lo:hi, :width],
        )


# [B, T-1] float fields; teacher_logp and the ones each rank computes last: they are optional
_PER_POSITION = ("weights", "advantages", "rollout_logp", "teacher_logp", "old_logp",
                 "ref_logp", "old_values", "returns")
_RANK_LOCAL = ("old_logp", "ref_logp", "old_values", "returns")  # computed by each rank after the scatter


def _place(out: np.ndarray, values: np.ndarray, lens: np.ndarray, starts: np.ndarray) -> None:
    """Write row i's `lens[i]` values (consecutive in `values`) into `out[i]` from column
    `starts[i]`: one scatter for the whole batch (a slice assignment per row cost a few torch
    ops a sample, ~20 ms of a tiny step's 512)."""
    total = int(lens.sum())
    if total:
        rows = np.repeat(np.arange(len(lens)), lens)
        first = np.cumsum(lens) - lens  # where each row's values begin in `values`
        out[rows, np.arange(total) - np.repeat(first - starts, lens)] = values


def collate(items: list[TrainItem], pad_id: int, device: torch.device) -> MicroBatch:
    samples = [it.sample for it in items]
    P = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
    R = np.array([s.response_len for s in samples], dtype=np.int64)
    if ((P == 0) & (R > 0)).any():
        raise ValueError("a sample with an empty prompt: its first response token has no "
                         "position to be predicted from")
    lengths = (P + R).tolist()
    B, T = len(items), max(lengths)
    with_teacher = [s.teacher_logprobs is not None for s in samples]
    if any(with_teacher) and not all(with_teacher):
        raise ValueError(f"{sum(with_teacher)} of {len(items)} samples carry teacher log-probs: "
                         "a batch needs them on every sample or none")
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    _place(input_ids, np.concatenate([s.prompt_ids for s in samples]), P, np.zeros_like(P))
    _place(input_ids, np.concatenate([s.response_ids for s in samples]), R, P)
    attention = (np.arange(T) < (P + R)[:, None]).astype(np.int64)

    def per_response(values: list[np.ndarray] | np.ndarray) -> np.ndarray:
        # response token j sits at position P+j and is predicted by the logits at P+j-1
        out = np.zeros((B, T - 1), dtype=np.float32)
        flat = values if isinstance(values, np.ndarray) else np.concatenate(values)
        _place(out, flat, R, P - 1)
        return out

    weights = per_response([it.weights for it in items])
    adv = per_response(np.repeat(np.array([it.advantage for it in items], np.float32), R))
    rollout_logp = per_response([s.rollout_logprobs for s in samples])
    teacher_logp = (per_response([s.teacher_logprobs for s in samples]) if all(with_teacher)
                    else None)
    routed = collate_routed(items, T)
    media = collate_media(items)
    input_ids, attention, weights, adv, rollout_logp = map(
        torch.from_numpy, (input_ids, attention, weights, adv, rollout_logp))
    teacher_logp = None if teacher_logp is None else torch.from_numpy(teacher_logp)
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        targets=input_ids[:, 1:].to(device),
        weights=weights.to(device),
        advantages=adv.to(device),
        rollout_logp=rollout_logp.to(device),
        teacher_logp=None if teacher_logp is None else teacher_logp.to(device),
        seq_lens=tuple(lengths),
        media=None if media is None else MediaTensors(
            tensors={k: t.to(device) for k, t in media.tensors.items()}, counts=media.counts),
        routed=None if routed is None else routed.to(device),
    )


def collate_routed(items: list[TrainItem], width: int) -> Tensor | None:
    """The samples' routed experts as [B, width, layers x top-k] int32 (zeros past each row's
    prompt + response - 1, NOT_ROUTED rows kept as -1), or None unless every sample carries
    them (a batch mixing MoE samples with and without is one whose engines changed: trained
    without replay)."""
    arrays = [it.sample.routed_experts for it in items]
    if not arrays or any(a is None for a in arrays):
        return None
    tokens = [len(it.sample.prompt_ids) + it.sample.response_len - 1 for it in items]
    per = {len(a) // max(n, 1) for a, n in zip(arrays, tokens)}
    if len(per) != 1 or any(len(a) != n * next(iter(per)) for a, n in zip(arrays, tokens)):
        raise ValueError("samples' routed_experts do not cover prompt + response - 1 tokens "
                         "of one layers x top-k width each")
    per = per.pop()
    out = np.zeros((len(items), width, per), dtype=np.int32)
    lens = np.array(tokens, dtype=np.int64)
    _place(out, np.concatenate(arrays).reshape(-1, per), lens, np.zeros_like(lens))
    return torch.from_numpy(out)


def mini_batch_order(rows: int, blocks: int, num_steps: int) -> list[int]:
    """The order to lay a whole batch's rows out in before `scatter_batch` hands `blocks` data
    ranks equal contiguous blocks that each cut theirs into `num_steps` contiguous mini-batches
    (trainer.num_steps_per_rollout): rank d's k-th piece is then share d of the batch's k-th
    contiguous slice, so mini-batch k holds the same rows on any number of ranks as on one (a
    two-rank step is the one-rank step, up to the order of float sums). Identity for one rank
    or one step, and where the rows do not split (the trainer refuses those)."""
    if blocks == 1 or num_steps == 1 or rows % (blocks * num_steps):
        return list(range(rows))
    size = rows // num_steps  # one mini-batch, over every rank
    share = size // blocks
    return [k * size + d * share + j
            for d in range(blocks) for k in range(num_steps) for j in range(share)]


def scatter_batch(batch: MicroBatch | None, device: torch.device,
                  data_ranks: list[int] | None = None) -> MicroBatch:
    """Rank 0 holds the whole collated batch (on the CPU); every rank gets its equal block of
    rows on `device`: block `data_ranks[r]` for global rank r (default: block r; model-parallel
    peers share a block). Collective: every rank calls it (the others with None)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data_ranks = list(range(world)) if data_ranks is None else data_ranks
    blocks_n = len(set(data_ranks))
    # rows, width, teacher log-probs present, media present, routed experts per token (0: none)
    head = torch.zeros(5, dtype=torch.long, device=device)
    if rank == 0:
        assert len(batch) % blocks_n == 0, "batch not divisible by data-parallel ranks"
        head = torch.tensor([len(batch) // blocks_n, batch.input_ids.shape[1],
                             int(batch.teacher_logp is not None), int(batch.media is not None),
                             0 if batch.routed is None else batch.routed.shape[2]],
                            device=device)
    dist.broadcast(head, src=0)
    rows, width, teacher, with_media, routed_per_token = head.tolist()

    def part(name: str, dtype: torch.dtype, w: int, *inner: int) -> Tensor:
        out = torch.empty((rows, w, *inner), dtype=dtype, device=device)
        blocks = None
        if rank == 0:
            split = getattr(batch, name).to(device).split(rows)
            blocks = [split[d].contiguous() for d in data_ranks]
        dist.scatter(out, blocks, src=0)
        return out

    input_ids = part("input_ids", torch.long, width)
    attention_mask = part("attention_mask", torch.long, width)
    # text batches skip the media header's two collectives
    media = (_scatter_media(batch.media if rank == 0 else None, rows, device,
                            data_ranks[rank]) if with_media else None)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:],
        **{name: part(name, torch.float32, width - 1) for name in _PER_POSITION
           if name not in ("teacher_logp", *_RANK_LOCAL) or (name == "teacher_logp" and teacher)},
        seq_lens=tuple(attention_mask.sum(1).tolist()),  # one device->host copy per step
        media=media,
        routed=part("routed", torch.int32, width, routed_per_token) if routed_per_token else None,
    )


def _broadcast_json(value: object, device: torch.device) -> object:
    """A small JSON header from rank 0 to every rank (as bytes in a tensor: no pickle)."""
    raw = torch.tensor(list(json.dumps(value).encode()) if dist.get_rank() == 0 else [],
                       dtype=torch.uint8, device=device)
    size = torch.tensor([raw.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(raw, src=0)
    return json.loads(bytes(raw.cpu().tolist()).decode())


def _scatter_media(media: MediaTensors | None, rows: int, device: torch.device,
                   block: int) -> MediaTensors | None:
    """Rank 0's media tensors to every rank (whole: their sizes vary by row); each rank keeps
    its block of rows (its data-parallel index: model-parallel peers share it). Collective."""
    rank = dist.get_rank()
    head = None
    if rank == 0 and media is not None:
        head = {k: [str(t.dtype).removeprefix("torch."), list(t.shape), list(media.counts[k])]
                for k, t in media.tensors.items()}
    head = _broadcast_json(head, device)
    if head is None:
        return None
    tensors = {}
    for name, (dtype, shape, _) in head.items():
        t = (media.tensors[name].to(device).contiguous() if rank == 0 else
             torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        dist.broadcast(t, src=0)
        tensors[name] = t
    whole = MediaTensors(tensors=tensors,
                         counts={k: tuple(v[2]) for k, v in head.items()})
    return whole.rows(block * rows, (block + 1) * rows)
