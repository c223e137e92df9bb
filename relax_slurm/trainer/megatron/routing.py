"""Routing replay (R3) and the routing comparison for megatron-core's MoE routers.

megatron-core 0.16 routes in `TopKRouter.routing(logits)` over the micro-batch's tokens in its
activation layout, [S, B] flattened sequence-major (token s * B + b; under sequence parallelism
the comparison is skipped and replay refused, context parallelism with replay at config time).
Its own `RouterReplay` (built when the provider sets `moe_enable_routing_replay`) substitutes
given top-k ids in `REPLAY_FORWARD`: the probabilities are then the router's own scores
gathered at those ids (softmax over them, or the pre-softmax scores, as the router is
configured), so the router still learns.
Around one forward, each router's `routing` is wrapped to
- compare the router's own top-k set with the rollout's (train/routing_mismatch_frac), and
- with replay, hand `RouterReplay` the rollout's ids (the router's own ids where the rollout
  has none: padding, each row's last token), then route as usual.
Nothing is recomputed in backward (no activation recompute), so no backward replay is needed.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from relax_slurm.errors import ConfigError
from relax_slurm.routing.hooks import RoutingStats, same_sets

log = logging.getLogger("relax_slurm.trainer.megatron")

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


_WARNED = False


def _warn_unmapped_once() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        log.warning("train/routing_mismatch_frac is not measured under sequence parallelism "
                    "(MoE at TP > 1): set rollout.return_routed_experts=false to spare the "
                    "engines its buffer, or train at TP=1 to measure it")


@contextlib.contextmanager
def megatron_routing(chunks: list[nn.Module], routed: Tensor, valid: Tensor, *, replay: bool,
                     stats: RoutingStats | None) -> Iterator[None]:
    """Inside: forwards of `chunks` on a [B, W] micro-batch compare (into `stats`) and, with
    `replay`, replay the rollout's routing `routed` [B, W, layers x K] at `valid` [B, W]."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    B, W = valid.shape
    mask = valid.transpose(0, 1).reshape(-1)  # sequence-major, as the router sees tokens
    routers = megatron_routers(chunks)
    if any(getattr(r.config, "sequence_parallel", False) for _, r in routers):
        # an MoE model at TP > 1 (build_provider turns sequence parallelism on, as megatron-core
        # requires): each TP rank's routers see a slice of the sequence, which neither the
        # replay nor the comparison maps. Replay is refused at config validation
        # (cross_checks.check_routing_replay); the comparison alone (rollout.return_routed_experts,
        # on by default) is skipped rather than failing the run
        if replay:
            raise ConfigError(
                "algo.routing_replay=true under trainer=megatron with sequence parallelism "
                "(an MoE model at trainer.tensor_parallel_size > 1): each TP rank's routers "
                "see a slice of the sequence, which the replay does not map. Fix: "
                "trainer.tensor_parallel_size=1 with the experts over "
                "trainer.expert_parallel_size (docs/backends.md#moe-and-sequence-parallelism)")
        _warn_unmapped_once()
        yield
        return
    for layer, router in routers:
        want = (routed.reshape(B, W, -1, router.topk)[:, :, layer].transpose(0, 1)
                .reshape(-1, router.topk).long())
        original = router.routing

        def routing(logits, *args, _router=router, _want=want, _original=original, **kwargs):
            flat = logits.reshape(-1, logits.shape[-1])
            own = own_topk(_router, flat.detach())
            want_here = _want.to(own.device)
            if stats is not None:  # every position, masked: no boolean index (a host sync)
                stats.add(mask.to(own.device), same_sets(own, want_here))
            if not replay:
                return _original(logits, *args, **kwargs)
            rr = _router.router_replay
            rr.target_topk_idx = torch.where(mask.to(own.device)[:, None], want_here, own)
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
