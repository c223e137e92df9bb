"""The pad token's embedding row under trainer=megatron gets HF's gradient
(`nn.Embedding(padding_idx=...)`: none from the lookup, a tied head's use kept) at TP=2, with
and without sequence parallelism and with the pad id in either vocabulary shard
(relax_slurm/trainer/megatron/pad_embedding.py; tests/integration/scripts/
megatron_pad_embedding.py, one two-rank torchrun on a lone VocabParallelEmbedding). TP=1 and
the whole model are compared with the torch backend in test_megatron_critic.py, whose batch
holds the pad token among real ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import run_logged  # noqa: E402

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_pad_embedding.py"

pytestmark = [pytest.mark.slow, NEEDS_MEGATRON]


@pytest.mark.timeout(600)
def test_pad_row_gradient_is_hfs_at_tp2_with_and_without_sequence_parallelism(tmp_path):
    log = tmp_path / "torchrun.log"
    rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", str(SCRIPT), "--out", str(tmp_path / "out")],
                    log, 500)
    assert rc == 0, log.read_text()[-6000:]
    cases = json.loads((tmp_path / "out" / "result.json").read_text())
    assert sorted(cases) == ["pad0_sp", "pad0_tp", "pad11_sp", "pad11_tp"]
    for name, c in cases.items():
        # the same lookups and sums of the same few terms: float32 rounding at most
        assert c["out_gap"] <= 1e-6, name  # rows of a randn matrix, O(1)
        assert c["grad_gap"] <= 1e-6 * c["grad_scale"], name
        # without the fix the pad row's gradient is not HF's: the case has teeth
        assert c["unfixed_gap"] > 0.1 * c["grad_scale"], name
