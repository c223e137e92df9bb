"""Routing replay under trainer=megatron: megatron-core's routers (through megatron-bridge, on
CPU/gloo) compare and replay the routing a bf16 hf engine reported, at TP=1, with expert
parallelism (EP=2 over 2 ranks) and at TP=2, where megatron-core trains the MoE with sequence
parallelism (each TP rank's routers see a slice of the sequence).
tests/integration/scripts/megatron_routing.py, one torchrun per rank count, all on one batch from
tests/helpers_moe.py (generated once, like the torch trainer's test)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the helpers
from helpers_moe import LAYERS, TOPK, bf16_routed_batch, make_moe_model  # noqa: E402
from helpers_tiny import run_logged  # noqa: E402

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_routing.py"
LAYOUTS = {"tp1": (1, 1, 1), "ep2": (2, 1, 2), "tp2": (2, 2, 1)}  # ranks, TP, EP

pytestmark = [
    pytest.mark.slow,
    NEEDS_MEGATRON,
]


@pytest.fixture(scope="module")
def routing_runs(tmp_path_factory) -> tuple[dict[str, Path], object]:
    """(each layout's output directory, the batch), every layout on one batch."""
    root = tmp_path_factory.mktemp("megatron_routing")
    moe_dir = make_moe_model(root / "model")
    mb = bf16_routed_batch(moe_dir, root)
    batch = root / "batch.pt"
    torch.save({"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
                "weights": mb.weights, "advantages": mb.advantages,
                "rollout_logp": mb.rollout_logp, "seq_lens": list(mb.seq_lens),
                "routed": mb.routed}, batch)
    argv: dict[int, list[str]] = {}  # one torchrun per rank count (script_result.each_layout)
    for name, (ranks, tp, ep) in LAYOUTS.items():
        args = argv.setdefault(ranks, [])
        args += [*(["+"] if args else []), "--model-dir", str(moe_dir), "--batch", str(batch),
                 "--tp", str(tp), "--ep", str(ep), "--out", str(root / name)]
    for ranks, args in argv.items():
        log = root / f"ranks{ranks}.log"
        rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", str(ranks), str(SCRIPT), *args], log, 900)
        assert rc == 0, log.read_text()[-6000:]
    return {name: root / name for name in LAYOUTS}, mb


def result(d: Path) -> dict:
    return json.loads((d / "result.json").read_text())


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_replays_the_rollouts_routing(routing_runs, layout):
    runs, mb = routing_runs
    res = result(runs[layout])
    assert res["sequence_parallel"] == (layout == "tp2")
    own, replayed = res["own"], res["replayed"]
    tokens = sum(n - 1 for n in mb.seq_lens)
    assert own["pairs"] == replayed["pairs"] == LAYERS * tokens
    assert own["mismatched"] > 0, "bf16 engine and fp32 Megatron agreed everywhere: no test"
    assert replayed["mismatched"] == own["mismatched"]  # always against the router's own choice
    # the experts every router used (gathered over the TP ranks' slices at TP=2) are the
    # rollout's at every covered token
    assert all(replayed["routed_as_asked"]) and len(replayed["routed_as_asked"]) == LAYERS
    assert not all(own["routed_as_asked"])  # without replay the router kept its own choice
    gap_own, gap_replayed = torch.tensor(own["gap"]), torch.tensor(replayed["gap"])
    changed = (gap_own - gap_replayed).abs() > 1e-4
    assert changed.any()
    assert gap_replayed[changed].mean() < gap_own[changed].mean()
    assert gap_replayed.sum() < gap_own.sum()
    # the training step's metric is the forward's comparison, every rank's tokens counted
    frac = res["step"]["train/routing_mismatch_frac"]
    assert frac == pytest.approx(own["mismatched"] / own["pairs"], rel=1e-12)


@pytest.mark.timeout(1500)
def test_tp2_replay_equals_tp1(routing_runs):
    """Same weights, same batch, the same experts at every covered token (replayed): TP=2 with
    sequence parallelism computes TP=1's function, so log-probs, loss, metric and gradients
    differ only by the order of float32 sums."""
    runs, mb = routing_runs
    one, two = result(runs["tp1"]), result(runs["tp2"])
    # the comparison counts: the same tokens against the same rollout ids. The router's own
    # top-k set can differ between the layouts only at a token whose k-th and (k+1)-th logits
    # are closer than twice the layouts' largest logit difference (float32 sums in another
    # order): with every covered token's margin above that, the sets, and so the integer
    # counts, must be equal
    for layer, l1 in one["own"]["router_logits"].items():
        a, b = torch.tensor(l1), torch.tensor(two["own"]["router_logits"][layer])
        top = a.topk(TOPK + 1, dim=-1).values
        margin = (top[:, TOPK - 1] - top[:, TOPK]).min()
        assert margin > 2 * (a - b).abs().max(), layer
    for key in ("pairs", "mismatched"):
        assert two["own"][key] == one["own"][key], key
    assert (two["step"]["train/routing_mismatch_frac"]
            == one["step"]["train/routing_mismatch_frac"])
    # log-probs: the same function, float32 sums in another order (measured 4.8e-7 at most;
    # |logit| < 10 has an ulp of ~1e-6): ten ulps
    logp1, logp2 = torch.tensor(one["replayed"]["logp"]), torch.tensor(two["replayed"]["logp"])
    torch.testing.assert_close(logp2, logp1, rtol=0, atol=1e-5)
    # the loss: each token's term w * A * (a weight exp(logp - rollout_logp), the ratio or the
    # TIS weight; clipping only lowers the slope) moves with its log-prob by at most
    # |w * A| * e^gap, so |dL| <= sum(|w * A|) * e^max_gap * max |d logp|, the last x2 for the
    # step's own micro-batch shapes (another order of sums than the forward above). The loss
    # itself is a cancellation (~4e-5 of sum|w * A| ~ 1): a relative bound on it would not hold
    w, adv = mb.weights, mb.advantages
    ratio = float(torch.tensor(one["replayed"]["gap"]).max().exp())
    bound = float((w * adv).abs().sum()) * ratio * 2 * float((logp2 - logp1).abs().max())
    assert abs(two["step"]["train/loss"] - one["step"]["train/loss"]) <= bound
    # gradients: float32 sums in another order, whose error scales with the terms summed, so
    # bounded relative to each tensor's largest entry. Measured: TP=1 alone with micro-batches
    # of 16 rows instead of 32 (the same function, another order) moves them by up to 8.6e-7
    # of that scale, TP=2 by 1.1e-6; 1e-5 is ten times either
    g1, g2 = (load_file(str(runs[k] / "grads.safetensors")) for k in ("tp1", "tp2"))
    assert sorted(g1) == sorted(g2)
    for k in g1:
        scale = float(g1[k].abs().max())
        assert scale > 0, k  # every parameter took part in the step
        assert float((g2[k] - g1[k]).abs().max()) <= 1e-5 * scale, k
