"""trainer.towers=split: each tensor-parallel rank encodes its share of a micro-batch's media
items with its (replicated) tower, and the features are all-gathered over TP.

Replicated towers (the default) run every item on every TP rank: the same pixels, the same
features, TP times the tower's compute. Split, the items of one tower call (the images, or the
videos, or the audios of the micro-batch) are cut into TP contiguous blocks of about equal rows
(patches or mel frames); rank r encodes block r and the blocks are all-gathered in rank order,
which is item order, so the features are placed at the pads exactly as before. The weights stay
whole on every rank (no TP'd tower implementation is needed, and the export is unchanged).

The gradient: the language model hands every TP rank the same gradient of the features (its
first column-parallel layer all-reduces its input gradient over TP; under sequence parallelism
the scatter's backward all-gathers it), so rank r back-propagates its own block's rows and gets
its items' share G_r of the tower's gradient. Megatron's finalize averages the towers' gradients
over TP (`average_gradients_across_tp_domain`, ReduceOp.AVG); the rows' gradient is scaled by TP
on the way in, so the average is sum_r G_r: the replicated tower's gradient.

With fewer items than TP ranks the call runs replicated (a rank with nothing to encode would
have no output shape to gather).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor

REPLICATED, SPLIT = "replicated", "split"


def blocks(rows: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Items [0, n) cut into `parts` contiguous non-empty blocks (start, end) of about equal
    total rows: block r ends at the first item whose running total reaches (r + 1) / parts of
    all rows, leaving at least one item for each later block. Needs n >= parts."""
    n, total = len(rows), sum(rows)
    assert n >= parts >= 1, (n, parts)
    out, start, running = [], 0, 0
    for r in range(parts - 1):
        end = start + 1
        running += rows[start]
        # grow while the next item still fits under this block's share and leaves one for each
        # of the blocks after it
        while end < n - (parts - 1 - r) and (running + rows[end]) * parts <= total * (r + 1):
            running += rows[end]
            end += 1
        out.append((start, end))
        start = end
    out.append((start, n))
    return out


class _GatherBlocks(torch.autograd.Function):
    """Forward: this rank's block rows -> every rank's, concatenated in rank order (all-gather,
    padded to the longest block). Backward: the rows of this rank's block, times the group's
    size (finalize averages the towers' gradients over TP)."""

    @staticmethod
    def forward(ctx, local: Tensor, sizes: list[int], rank: int, group) -> Tensor:
        ctx.sizes, ctx.rank, ctx.world = sizes, rank, len(sizes)
        longest = max(sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[:local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]] * ctx.world, None, None, None


def encode_split(encode: Callable[[int, int], list[Tensor]], rows: Sequence[int]
                 ) -> list[Tensor]:
    """`encode(start, end)` runs the tower on items [start, end) and returns its outputs (the
    features, and any per-token extras such as DeepStack features), each with one row per
    output token of those items, in order. `rows[i]`: item i's input rows (patches, mel
    frames: what the work scales with). Returns what `encode(0, n)` would, each TP rank having
    encoded only its block."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or len(rows) < tp:
        return encode(0, len(rows))
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    local = encode(*blocks(rows, tp)[rank])
    # each block's output rows (a tower's output length is its own business: ask it)
    counts = [torch.zeros(1, dtype=torch.long, device=local[0].device) for _ in range(tp)]
    dist.all_gather(counts, torch.tensor([local[0].shape[0]], device=local[0].device),
                    group=group)
    sizes = [int(c) for c in counts]
    return [_GatherBlocks.apply(t, sizes, rank, group) for t in local]


def vision(tower: Callable[[Tensor, Tensor], tuple[Tensor, list[Tensor]]], split: bool
           ) -> Callable[[Tensor, Tensor], tuple[Tensor, list[Tensor]]]:
    """`tower(pixels, grid_thw) -> (features, DeepStack features)` run over the images (or
    videos) of one call split over TP when `split`: an item is one image or video, its rows
    its patches (grid t x h x w), its pixels the next that many rows."""
    if not split:
        return tower

    def run(pixels: Tensor, grid: Tensor) -> tuple[Tensor, list[Tensor]]:
        patches = grid.prod(-1).tolist()
        offsets = [0, *accumulate(patches)]

        def encode(a: int, b: int) -> list[Tensor]:
            features, deepstack = tower(pixels[offsets[a]:offsets[b]], grid[a:b])
            return [features, *deepstack]

        out = encode_split(encode, patches)
        return out[0], out[1:]

    return run


def audio(encoder: Callable[[Tensor, Tensor], Tensor], split: bool
          ) -> Callable[[Tensor, Tensor], Tensor]:
    """`encoder(features [A, mel, frames], feature_mask [A, frames]) -> [tokens, H]` (every
    audio's embeddings in order) split over TP when `split`: an item is one audio, its rows
    its valid mel frames."""
    if not split:
        return encoder

    def run(features: Tensor, mask: Tensor) -> Tensor:
        return encode_split(lambda a, b: [encoder(features[a:b], mask[a:b])],
                            mask.sum(-1).tolist())[0]

    return run


def is_split(config) -> bool:
    """Whether the model's provider says trainer.towers=split (build_provider sets it)."""
    return getattr(config, "towers", REPLICATED) == SPLIT
