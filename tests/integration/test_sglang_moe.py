"""A mixture-of-experts model on the real SGLang (CPU, the venv of relax-sglang-cpu), with the
routed experts (R3) it reports: the tiny Qwen3-MoE's log-probs and every position's and layer's
top-k experts are transformers' (float32 on both sides), on its own weights and on other
weights pushed over the weight-update group as a trainer pushes them. What routing replay
trains on (docs/algorithms.md, docs/engines.md#sglang-on-cpu): the rollout worker's client and
decoder read SGLang's answers here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import free_port, run_script, start_sglang_engine, stop_process  # noqa: E402
from helpers_tiny import wait_healthy  # noqa: E402

from relax_slurm.engines.sglang_api import API_KEY_ENV, ROUTED_EXPERTS_FLAG  # noqa: E402
from relax_slurm.tiny.model import main as make_tiny_model  # noqa: E402

KEY = "moe-key"
# float32 on both sides, other kernels (SGLang's native MoE and attention on CPU): measured
# within 5e-7 on the tiny MoE, as the dense text and VL models are within 1e-5
LP_TOL = 1e-5
# A top-k set can only differ where the k-th and (k+1)-th router logits are within the two
# forwards' float32 disagreement of each other (~1e-6 here): a near-tie, not a wrong routing
NEAR_TIE = 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu, pytest.mark.timeout(600)]


def test_sglang_reports_the_routed_experts_transformers_would_choose(tmp_path,
                                                                     sglang_cpu_python):
    model_dir = tmp_path / "moe"
    assert make_tiny_model(["--out", str(model_dir), "--kind", "moe"]) == 0
    port, log = free_port(), tmp_path / "engine.log"
    proc = start_sglang_engine(sglang_cpu_python, model_dir, port, log, api_key=KEY,
                               extra_args=[ROUTED_EXPERTS_FLAG])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, log)
        r = run_script("moe_routing_parity.py", tmp_path, "--url", url, model_dir=model_dir,
                       env={API_KEY_ENV: KEY})
    finally:
        stop_process(proc)
    for name, version in (("own", "1"), ("other", "2")):
        got = r[name]
        assert got["version"] == version, r
        # 4 prompts x 4 samples, each of its prompt + 8 new tokens - 1 positions x 2 layers
        assert got["rows"] == 16 and got["positions"] == 2 * 4 * (5 + 2 + 7 + 4 + 4 * 7), r
        assert got["max_lp_diff"] < LP_TOL, r
        assert got["mismatched"] == 0 or got["min_gap_mismatched"] < NEAR_TIE, r
        assert got["mismatched"] <= 2, r  # near-ties are rare: none seen in the measured runs
