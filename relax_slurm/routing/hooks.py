"""Record, compare and replay a transformers MoE model's expert choices.

transformers 5's MoE decoders (Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE, Qwen3-Omni-MoE) route with a
`...TopKRouter` module at `layers.N.mlp.gate` whose forward maps hidden states [tokens, H] to
(router_logits [tokens, E], top-k weights [tokens, K], top-k expert ids [tokens, K]); the experts
then run on those ids with those weights. A forward hook on the router sees every choice and may
replace it:

- `RoutingTrace` (the hf engine) records each forward's ids per layer;
- `routing_replay` (the trainer) compares each layer's own choice with the rollout's and, when
  replaying, substitutes the rollout's ids, with weights recomputed from the trainer's own
  router logits (softmax, gathered at the replayed ids, renormalised as the router does), so
  the router still gets gradients.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


_ROUTERS: "weakref.WeakKeyDictionary[nn.Module, list[tuple[int, nn.Module]]]" = \
    weakref.WeakKeyDictionary()


def moe_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router) of the text decoder's MoE layers, in layer order. Only the
    first decoder stack counts (Qwen3-Omni's talker has routers of its own, never trained).
    Found once per model (a walk over every module; the trainer asks every micro-batch)."""
    if model not in _ROUTERS:
        _ROUTERS[model] = _find_routers(model)
    return _ROUTERS[model]


def _find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    found: dict[str, list[tuple[int, nn.Module]]] = {}
    for name, module in model.named_modules():
        m = _LAYER.search(name)
        if m and type(module).__name__.endswith("TopKRouter"):
            stack = name[:m.start()]
            found.setdefault(stack, []).append((int(m.group(1)), module))
    if not found:
        return []
    return sorted(next(iter(found.values())), key=lambda x: x[0])


@dataclass
class RoutingTrace:
    """Every router call of the forwards run inside `record()`: per layer, the [B, T, K] ids of
    each call, in call order (a generate call: the prefill, then one call per new token)."""

    batch: int
    calls: dict[int, list[Tensor]] = field(default_factory=dict)

    @contextlib.contextmanager
    def record(self, model: nn.Module) -> Iterator["RoutingTrace"]:
        def hook_for(layer: int):
            def hook(module, args, output):
                ids = output[2]
                self.calls.setdefault(layer, []).append(ids.reshape(self.batch, -1, ids.shape[-1]))
            return hook

        handles = [r.register_forward_hook(hook_for(i)) for i, r in moe_routers(model)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def rows(self, layers: int, lengths: list[int], left_pad: list[int]) -> list[Tensor]:
        """Row i's ids [lengths[i], layers, K] (int32; dense layers' columns zero), from a
        left-padded prefill of its first tokens followed by one-token decode calls: position
        p < prefill width - pad comes from the prefill, the rest from the decode calls."""
        if not self.calls:
            raise RuntimeError("no router ran: the model has no MoE layer")
        any_calls = next(iter(self.calls.values()))
        k = any_calls[0].shape[-1]
        per_layer = {i: torch.cat(c, dim=1) for i, c in self.calls.items()}  # [B, W+steps, K]
        # one [B, W+steps, layers, K] table, each row a view of it: a table per row cost a
        # zeros and a copy per layer for each of a tiny step's 512 rows (~6 ms)
        width = next(iter(per_layer.values())).shape[1]
        table = torch.zeros((self.batch, width, layers, k), dtype=torch.int32)
        for layer, seq in per_layer.items():
            table[:, :, layer] = seq
        return [table[b, pad:pad + n] for b, (n, pad) in enumerate(zip(lengths, left_pad))]


class RoutingStats:
    """Token x MoE-layer pairs compared, and how many of them the trainer's router would route
    to another top-k set than the rollout did (train/routing_mismatch_frac). The counts stay
    tensors on the model's device while layers add to them: reading one (a host sync on a GPU)
    happens once per step, not once per layer and micro-batch."""

    def __init__(self) -> None:
        self._pairs: Tensor | float = 0.0
        self._mismatched: Tensor | float = 0.0

    def add(self, valid: Tensor, same: Tensor) -> None:
        """One layer's comparison: `same` [N] bool (the sets agree) at `valid` [N] bool."""
        self._pairs = self._pairs + valid.sum()
        self._mismatched = self._mismatched + (valid & ~same).sum()

    @property
    def pairs(self) -> float:
        return float(self._pairs)

    @property
    def mismatched(self) -> float:
        return float(self._mismatched)


def same_sets(a: Tensor, b: Tensor) -> Tensor:
    """[N, K] x [N, K] -> [N] bool: the rows hold the same ids in any order."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


@contextlib.contextmanager
def routing_replay(model: nn.Module, routed: Tensor, valid: Tensor, *, replay: bool,
                   stats: RoutingStats | None = None) -> Iterator[None]:
    """Inside this context, the model's forwards on a [B, T] batch see the rollout's routing
    `routed` [B, T, layers x K] (valid [B, T] bool: the positions it covers). Each MoE layer adds
    its comparison to `stats`; with `replay` it routes the valid positions to the rollout's
    experts. Every forward inside must be on the same [B, T] batch."""
    B, T = valid.shape
    mask = valid.reshape(-1)

    def hook_for(layer: int, router: nn.Module):
        norm = bool(getattr(router, "norm_topk_prob", True))
        want = routed.reshape(B, T, -1, router.top_k)[:, :, layer].reshape(-1, router.top_k)
        want = want.long()  # [B*T, K]

        def hook(module, args, output):
            logits, weights, ids = output
            if stats is not None:
                with torch.no_grad():  # every position, masked: no boolean index (a sync)
                    stats.add(mask, same_sets(ids, want))
            if not replay:
                return None
            new_ids = torch.where(mask[:, None], want, ids)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            new_w = probs.gather(-1, new_ids)
            if norm:
                new_w = new_w / new_w.sum(dim=-1, keepdim=True)
            return logits, new_w.to(weights.dtype), new_ids

        return hook

    handles = [r.register_forward_hook(hook_for(i, r)) for i, r in moe_routers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
