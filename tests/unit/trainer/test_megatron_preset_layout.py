"""Every GPU preset (conf/experiment/qwen3_*) that trains with megatron-core passes
megatron-core's own parallel-layout checks, on this CPU machine, without a download and
without building the model (`megatron_layout_probe.py`: the bridge's provider from the real
model's shapes, TransformerConfig.__post_init__, initialize_model_parallel on a fake process
group of the preset's world size, layers per stage, experts per EP rank). Also: megatron-core
trains MoE layers under TP > 1 only with sequence parallelism, so the MoE presets run with it.
One subprocess for all (it holds a fake 16-rank process group): ~10 s, mostly imports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# megatron-bridge imports only through cpu_compat here (stubs for transformer-engine)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.bridge") is None,
                                reason="pip install --no-deps megatron-bridge==0.3.1")

ROOT = Path(__file__).resolve().parents[3]
MEGATRON_PRESETS = ["qwen3_4b_dapo", "qwen3_30b_a3b_dapo", "qwen3_vl_4b_openr1",
                    "qwen3_vl_30b_a3b_openr1", "qwen3_omni_30b_a3b_avqa"]
# valid for relax_slurm's own config checks (EP=3 divides DP=6), not for megatron-core:
# 128 experts do not split over 3 EP ranks (BaseMoELayer's assert)
BAD_EP = ["qwen3_30b_a3b_dapo", "trainer.nproc_per_node=6", "trainer.expert_parallel_size=3"]
# 32 attention heads over TP=3 (TransformerConfig.__post_init__)
BAD_TP = ["qwen3_4b_dapo", "trainer.nproc_per_node=3", "trainer.tensor_parallel_size=3"]


@pytest.fixture(scope="module")
def probed() -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    runs = MEGATRON_PRESETS + [json.dumps(BAD_EP), json.dumps(BAD_TP)]
    out = subprocess.run([sys.executable, "-m", "tests.unit.trainer.megatron_layout_probe",
                          *runs], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(runs), out.stdout + out.stderr[-3000:]
    return lines


def test_megatron_presets_are_all_probed():
    """Every qwen3_* preset on trainer=megatron is in MEGATRON_PRESETS (all of them now)."""
    from relax_slurm.launch.submit import compose_config

    on_megatron = sorted(
        p.stem for p in (ROOT / "conf" / "experiment").glob("qwen3_*.yaml")
        if compose_config([f"experiment={p.stem}", "run_dir=/tmp/x"]).trainer.backend
        == "megatron")
    assert on_megatron == sorted(MEGATRON_PRESETS)


@pytest.mark.parametrize("index", range(len(MEGATRON_PRESETS)),
                         ids=MEGATRON_PRESETS)
def test_preset_passes_megatron_layout_checks(probed, index):
    r = probed[index]
    assert r["preset"] == MEGATRON_PRESETS[index]
    assert r["ok"], r.get("error")
    assert r["layers_per_stage"] in (36, 48)
    if r["moe"]:  # 128 experts over EP=8, and the sequence parallelism MoE at TP=2 needs
        assert (r["world"], r["dp"], r["local_experts"]) == (16, 8, 16)
        assert r["tp_group"] == 2 and r["sequence_parallel"]
    else:  # dense: the path CI runs, without sequence parallelism
        assert not r["sequence_parallel"]


def test_megatron_refuses_a_layout_our_checks_let_through(probed):
    """The probe reports megatron-core's own refusals (so a passing preset means something)."""
    bad_ep, bad_tp = probed[len(MEGATRON_PRESETS):]
    assert not bad_ep["ok"] and bad_ep["at"].startswith("moe_layer.py:"), bad_ep
    assert not bad_tp["ok"] and "num_attention_heads (32)" in bad_tp["error"], bad_tp
