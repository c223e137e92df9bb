"""Vision-language models under trainer=megatron on CPU/gloo (relax_slurm/trainer/megatron/vl.py):
the tiny Qwen2.5-VL and Qwen3-VL built through megatron-bridge at TP=1 and TP=2 against the
transformers model, on two right-padded rows with images of different sizes
(tests/integration/scripts/megatron_vl_parity.py, one torchrun each)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import run_logged  # noqa: E402

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_vl_parity.py"
pytestmark = [pytest.mark.slow, NEEDS_MEGATRON]

# float32 throughout. What may differ from transformers is the order of float32 sums: TP=2
# adds two partial products per row-parallel matmul and all-reduces them, megatron's fused
# QKV and gate/up layouts, and the vision tower's gradient arrives through the language model's
# column-parallel backward (an all-reduce of partial input gradients). Each of those is a few
# ulps (2^-24 ~ 6e-8 relative) per reduction over a few hundred terms in these 64-wide models;
# 1e-5 of the reference's largest magnitude is ~100x what was measured (~1e-7 relative) and
# ~1000x below what a wrong position, mask or image placement gives (>= 1e-2).
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from relax_slurm.tiny.model import main

    root = tmp_path_factory.mktemp("megatron_vl")
    out = {}
    for kind in ("vl", "vl3"):
        model = root / f"{kind}_model"
        assert main(["--out", str(model), "--kind", kind]) == 0
        for tp in (1, 2):
            d = root / f"{kind}_tp{tp}"
            log = root / f"{kind}_tp{tp}.log"
            rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", str(tp), str(SCRIPT), "--model-dir", str(model),
                             "--tp", str(tp), "--out", str(d)], log, timeout_s=600)
            assert rc == 0, log.read_text()[-6000:]
            out[f"{kind}_tp{tp}"] = d
        out[kind] = model
    return out


def result(d: Path) -> dict:
    return json.loads((d / "result.json").read_text())


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["vl", "vl3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_vision_gradients_equal_transformers(runs, kind, tp):
    r = result(runs[f"{kind}_tp{tp}"])
    assert r["logits_max_diff"] <= REL_TOL * r["logits_scale"], r["logits_max_diff"]
    for name, g in r["vision_grads"].items():
        assert g["scale"] > 0, name  # the tower is in the graph
        assert g["max_diff"] <= REL_TOL * g["scale"], (name, g)
        assert g["equal_across_ranks"], name  # replicated over TP, same gradient


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["vl", "vl3"])
def test_export_is_what_the_hf_engine_loads(runs, kind):
    """The bridge's export equals the checkpoint file bit for bit at TP=2 and every name is one
    the hf engine receives (Qwen2.5-VL: the files' names, aliases of transformers 5's)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from relax_slurm.weightsync.receiver import parameter_views

    r = result(runs[f"{kind}_tp2"])
    assert r["exported_names"] == r["file_names"]
    assert r["export_bitwise"]
    model = AutoModelForImageTextToText.from_pretrained(runs[kind], dtype=torch.float32)
    assert set(r["exported_names"]) <= set(parameter_views(model))
