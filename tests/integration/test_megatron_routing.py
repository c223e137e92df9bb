"""Routing replay under trainer=megatron: megatron-core's routers (through megatron-bridge, on
CPU/gloo) compare and replay the routing a bf16 hf engine reported, at TP=1 and with expert
parallelism (EP=2 over 2 ranks). tests/integration/scripts/megatron_routing.py, one torchrun
each; the batch comes from tests/helpers_moe.py like the torch trainer's test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the helpers
from helpers_moe import LAYERS, bf16_routed_batch, make_moe_model  # noqa: E402
from helpers_tiny import run_logged  # noqa: E402

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_routing.py"

pytestmark = [
    pytest.mark.slow,
    NEEDS_MEGATRON,
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks,tp,ep", [(1, 1, 1), (2, 1, 2)], ids=["tp1", "ep2"])
def test_megatron_replays_the_rollouts_routing(tmp_path, ranks, tp, ep):
    moe_dir = make_moe_model(tmp_path / "model")
    mb = bf16_routed_batch(moe_dir, tmp_path)
    batch = tmp_path / "batch.pt"
    torch.save({"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
                "weights": mb.weights, "advantages": mb.advantages,
                "rollout_logp": mb.rollout_logp, "seq_lens": list(mb.seq_lens),
                "routed": mb.routed}, batch)
    log = tmp_path / "torchrun.log"
    rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(ranks), str(SCRIPT), "--model-dir", str(moe_dir),
                     "--batch", str(batch), "--tp", str(tp), "--ep", str(ep),
                     "--out", str(tmp_path / "out")], log, 600)
    assert rc == 0, log.read_text()[-6000:]
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    own, replayed = res["own"], res["replayed"]
    tokens = sum(n - 1 for n in mb.seq_lens)
    assert own["pairs"] == replayed["pairs"] == LAYERS * tokens
    assert own["mismatched"] > 0, "bf16 engine and fp32 Megatron agreed everywhere: no test"
    assert replayed["mismatched"] == own["mismatched"]  # always against the router's own choice
    assert all(replayed["routed_as_asked"]) and len(replayed["routed_as_asked"]) == LAYERS
    assert not all(own["routed_as_asked"])  # without replay the router kept its own choice
    gap_own, gap_replayed = torch.tensor(own["gap"]), torch.tensor(replayed["gap"])
    changed = (gap_own - gap_replayed).abs() > 1e-4
    assert changed.any()
    assert gap_replayed[changed].mean() < gap_own[changed].mean()
    assert gap_replayed.sum() < gap_own.sum()
