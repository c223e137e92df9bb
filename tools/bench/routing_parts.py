"""Micro-benchmark of what routing replay (R3) adds to a step, part by part.

    python tools/bench/routing_parts.py [--groups 32] [--samples 16] [--tokens 8] [--layers 2]
                                        [--topk 2] [--experts 4] [--repeat 5]

Part 8 of run.py times whole runs with and without routing data, but on 2 shared cores a
60-step tiny MoE run drifts by more than R3 costs (docs/benchmarks.md "Where the misses come
from"). This times each piece R3 adds for one step's batch (groups x samples rows of `tokens`
routed positions): the engine's routing table of a generate call (`RoutingTrace.rows`) and its
base64, the worker's decode and check, the routed columns in a broker put (encode + decode),
and the trainer's `collate_routed`. Where a part was rewritten, the way it was done before
(one table and copy per row; a slice assignment per sample; two reductions a sample) is timed
beside it in the same run, as the baseline. Best of `repeat`, in ms.
"""

from __future__ import annotations

import argparse
import base64
import timeit

import numpy as np
import torch

from relax_slurm.broker import wire
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.routing.hooks import RoutingTrace
from relax_slurm.routing.shape import (WIRE_DTYPE, RoutingShape, decode_routed_experts,
                                       encode_routed_experts)
from relax_slurm.samples import Sample
from relax_slurm.trainer.batch import collate_routed, prepare_items


def rows_per_row(trace: RoutingTrace, layers: int, lengths: list[int], pads: list[int]):
    """RoutingTrace.rows as it was: a zeros tensor and a copy per layer for every row."""
    per_layer = {i: torch.cat(c, dim=1) for i, c in trace.calls.items()}
    k = next(iter(per_layer.values())).shape[-1]
    out = []
    for b, (n, pad) in enumerate(zip(lengths, pads)):
        ids = torch.zeros((n, layers, k), dtype=torch.int32)
        for layer, seq in per_layer.items():
            ids[:, layer] = seq[b, pad:pad + n]
        out.append(ids)
    return out


def collate_per_sample(items, width: int) -> torch.Tensor:
    """collate_routed as it was: a torch slice assignment per sample."""
    arrays = [it.sample.routed_experts for it in items]
    tokens = [len(it.sample.prompt_ids) + it.sample.response_len - 1 for it in items]
    out = torch.zeros((len(items), width, len(arrays[0]) // tokens[0]), dtype=torch.int32)
    for i, (a, n) in enumerate(zip(arrays, tokens)):
        out[i, :n] = torch.from_numpy(a.astype(np.int32).reshape(n, -1))
    return out


def decode_two_reductions(text: str, shape: RoutingShape, tokens: int) -> np.ndarray:
    """decode_routed_experts as it was: min() and max() for the bounds."""
    ids = np.frombuffer(base64.b64decode(text, validate=True), dtype=WIRE_DTYPE)
    if shape.tokens(len(ids)) != tokens:
        raise ValueError("tokens")
    if len(ids) and (ids.min() < 0 or ids.max() >= shape.experts):
        raise ValueError("range")
    return ids.astype(np.int16)


def measure(groups: int, samples_per_group: int, tokens: int, layers: int, topk: int, experts: int,
            repeat: int) -> dict[str, float]:
    batch = groups * samples_per_group
    shape = RoutingShape(layers=layers, topk=topk, experts=experts,
                         moe_layers=tuple(range(layers)))

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=3, repeat=repeat)) / 3 * 1e3

    # a generate call: a prefill of `tokens - 2` positions, then 2 one-token decode calls
    trace = RoutingTrace(batch)
    trace.calls = {layer: [torch.randint(0, experts, (batch, w, topk), dtype=torch.int32)
                           for w in (tokens - 2, 1, 1)] for layer in range(layers)}
    lengths, pads = [tokens] * batch, [0] * batch
    rows = trace.rows(layers, lengths, pads)
    texts = [encode_routed_experts(r.numpy()) for r in rows]
    prompt, response = tokens - 2, 3  # prompt + response - 1 routed positions

    def samples(routed: bool) -> list[list[Sample]]:  # the same rows, with or without routing
        r, n = np.random.default_rng(0), samples_per_group
        return [[Sample(prompt_id=f"p{g}", group_id=g, prompt_ids=r.integers(1, 17, prompt),
                        response_ids=r.integers(1, 17, response), loss_mask=np.ones(response),
                        rollout_logprobs=-r.random(response), reward=float(r.random()),
                        routed_experts=(decode_routed_experts(texts[g * n + i], shape, tokens)
                                        if routed else None))
                 for i in range(n)] for g in range(groups)]

    made, bare = samples(True), samples(False)
    items = prepare_items(made, AlgoConfig())
    width = prompt + response
    return {
        "engine_rows": best(lambda: trace.rows(layers, lengths, pads)),
        "engine_rows_before": best(lambda: rows_per_row(trace, layers, lengths, pads)),
        "engine_base64": best(lambda: [encode_routed_experts(r.numpy()) for r in rows]),
        "worker_decode": best(lambda: [decode_routed_experts(t, shape, tokens) for t in texts]),
        "worker_decode_before": best(
            lambda: [decode_two_reductions(t, shape, tokens) for t in texts]),
        "broker_put": best(lambda: wire.decode(wire.encode("put_groups", {}, made)))
        - best(lambda: wire.decode(wire.encode("put_groups", {}, bare))),
        "trainer_collate": best(lambda: collate_routed(items, width)),
        "trainer_collate_before": best(lambda: collate_per_sample(items, width)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    res = measure(a.groups, a.samples, a.tokens, a.layers, a.topk, a.experts, a.repeat)
    now = (res["engine_rows"] + res["engine_base64"] + res["worker_decode"]
           + max(res["broker_put"], 0.0) + res["trainer_collate"])
    before = (res["engine_rows_before"] + res["engine_base64"] + res["worker_decode_before"]
              + max(res["broker_put"], 0.0) + res["trainer_collate_before"])
    print(f"{a.groups * a.samples} rows of {a.tokens} routed positions, {a.layers} layers x "
          f"top-{a.topk} (ms, best of {a.repeat})")
    for part in ("engine_rows", "engine_base64", "worker_decode", "broker_put",
                 "trainer_collate"):
        base = res.get(f"{part}_before")
        print(f"  {part:16s} {res[part]:7.2f}" + ("" if base is None else
                                                  f"   (before: {base:.2f}, "
                                                  f"{base / max(res[part], 1e-9):.1f}x)"))
    print(f"  {'in all':16s} {now:7.2f}   (before: {before:.2f})")


if __name__ == "__main__":
    main()
