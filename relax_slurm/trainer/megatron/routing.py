"""Routing replay (R3) and the routing comparison for megatron-core's MoE routers.

megatron-core 0.16 routes in `TopKRouter.routing(logits)` over the tokens this rank holds, in
its activation layout: logits [S_local, B, E], flattened sequence-major (token s * B + b).
Which sequence positions those S_local rows are (`router_positions`):
- without sequence or context parallelism, the whole (micro-batch's) sequence;
- under sequence parallelism (an MoE model at TP > 1, model.needs_sequence_parallel), TP rank
  r's contiguous r-th of the sequence, padded to a multiple of TP: the embedding reduce-scatters
  (or scatter_to_sequence_parallel_region splits) dim 0 of [S, B, H] into TP equal chunks in
  TP-rank order (tensor_parallel/mappings.py _split_along_first_dim,
  _reduce_scatter_along_first_dim), and the MoE layer routes before its token dispatcher
  gathers anything (moe_layer.py MoELayer.route), so the router sees the rank's own slice;
  expert parallelism changes only where the chosen experts run, not which tokens a router sees;
- under context parallelism (GPU only), CP rank c's chunks c and 2CP-1-c of the sequence
  (context_parallel.chunk_positions, as Megatron-LM's get_batch_on_this_cp_rank), which
  sequence parallelism then splits as above.
megatron-core's own `RouterReplay` (built when the provider sets `moe_enable_routing_replay`)
substitutes given top-k ids in `REPLAY_FORWARD`: the probabilities are then the router's own
scores gathered at those ids (softmax over them, or the pre-softmax scores, as the router is
configured), so the router still learns.
Around one forward, each router's `routing` is wrapped to take the rollout's ids [B, W,
layers x K] and their mask [B, W] at this rank's positions (`rollout_view`; positions past the
rows' width, the padding to a multiple of TP, are masked), then
- compare the router's own top-k set with the rollout's (train/routing_mismatch_frac: every
  TP and CP rank counts its own tokens; step.py sums the counts over all ranks), and
- with replay, hand `RouterReplay` the rollout's ids (the router's own ids where the rollout
  has none: padding, each row's last token), then route as usual.
Replay under context parallelism stays refused at config validation
(cross_checks.check_routing_replay): its mapping is here, but CP runs only with
transformer-engine on GPUs, where it is not tested.
Nothing is recomputed in backward (no activation recompute), so no backward replay is needed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from relax_slurm.routing.hooks import RoutingStats, same_sets
from relax_slurm.trainer.megatron.context_parallel import chunk_positions

_ROUTERS: "weakref.WeakKeyDictionary[nn.Module, list[tuple[int, nn.Module]]]" = \
    weakref.WeakKeyDictionary()


def megatron_routers(chunks: list[nn.Module]) -> list[tuple[int, nn.Module]]:
    """(0-based decoder layer, TopKRouter) of the given model chunks (each chunk walked once:
    the trainer asks every micro-batch)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for c in chunks:
        if c not in _ROUTERS:
            _ROUTERS[c] = [(m.layer_number - 1, m) for m in c.modules()
                           if isinstance(m, TopKRouter)]
    return [r for c in chunks for r in _ROUTERS[c]]


def own_topk(router: nn.Module, logits: Tensor) -> Tensor:
    """The experts the router itself picks for [N, E] logits (group-limited routing aside):
    top-k of the logits for softmax routing, of sigmoid(logits) + expert bias for sigmoid."""
    scores = logits
    if getattr(router, "score_function", "softmax") == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if getattr(router, "expert_bias", None) is not None:
            scores = scores + router.expert_bias
    return torch.topk(scores, k=router.topk, dim=-1).indices


@dataclass(frozen=True)
class TokenSplit:
    """How this rank's routers see the sequence: `sp` TP ranks split it (1 without sequence
    parallelism) and `cp` context-parallel ranks before them."""

    sp: int = 1
    sp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0


def router_positions(rows: int, split: TokenSplit) -> Tensor:
    """The sequence positions [rows] of the `rows` sequence rows (logits' dim 0) a router on
    this rank sees, in its order (the module docstring gives megatron-core's split)."""
    seq = rows * split.sp  # this CP rank's part of the padded sequence
    pos = (chunk_positions(seq * split.cp, split.cp, split.cp_rank) if split.cp > 1
           else torch.arange(seq))
    return pos[split.sp_rank * rows:(split.sp_rank + 1) * rows]


def rollout_view(routed: Tensor, valid: Tensor, positions: Tensor, layer: int, topk: int
                 ) -> tuple[Tensor, Tensor]:
    """One layer's rollout ids [n x B, K] (int64) and mask [n x B] at `positions` [n], in the
    router's token order (position-major); positions past the width W of `routed` [B, W,
    layers x K] and `valid` [B, W] (padding to a multiple of TP) are masked."""
    B, W = valid.shape
    positions = positions.to(valid.device)
    at = positions.clamp(max=W - 1)
    want = routed.reshape(B, W, -1, topk)[:, at, layer]  # [B, n, K]
    mask = valid[:, at] & (positions < W)[None, :]  # [B, n]
    return want.transpose(0, 1).reshape(-1, topk).long(), mask.transpose(0, 1).reshape(-1)


def token_split(routers: list[tuple[int, nn.Module]]) -> TokenSplit:
    """This rank's TokenSplit from megatron's parallel state and the routers' config."""
    from megatron.core import parallel_state as ps

    sp = any(getattr(r.config, "sequence_parallel", False) for _, r in routers)
    return TokenSplit(sp=ps.get_tensor_model_parallel_world_size() if sp else 1,
                      sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
                      cp=ps.get_context_parallel_world_size(),
                      cp_rank=ps.get_context_parallel_rank())


@contextlib.contextmanager
def megatron_routing(chunks: list[nn.Module], routed: Tensor, valid: Tensor, *, replay: bool,
                     stats: RoutingStats | None) -> Iterator[None]:
    """Inside: forwards of `chunks` on a [B, W] micro-batch compare (into `stats`) and, with
    `replay`, replay the rollout's routing `routed` [B, W, layers x K] at `valid` [B, W], each
    router at the positions it sees on this rank."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = megatron_routers(chunks)
    split = token_split(routers)
    for layer, router in routers:
        original = router.routing

        def routing(logits, *args, _router=router, _layer=layer, _original=original, **kwargs):
            assert logits.shape[1] == valid.shape[0], (logits.shape, valid.shape)
            flat = logits.reshape(-1, logits.shape[-1])  # [S_local x B, E]
            own = own_topk(_router, flat.detach())
            want, mask = rollout_view(routed, valid, router_positions(logits.shape[0], split),
                                      _layer, _router.topk)
            want, mask = want.to(own.device), mask.to(own.device)
            if stats is not None:  # every position, masked: no boolean index (a host sync)
                stats.add(mask, same_sets(own, want))
            if not replay:
                return _original(logits, *args, **kwargs)
            rr = _router.router_replay
            rr.target_topk_idx = torch.where(mask[:, None], want, own)
            rr.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            try:
                return _original(logits, *args, **kwargs)
            finally:
                rr.router_replay_action, rr.target_topk_idx = None, None

        router.routing = routing
    try:
        yield
    finally:
        for _, router in routers:
            del router.routing  # the class's method again
