"""algo=ppo's critic under trainer=megatron (relax_slurm/trainer/megatron/critic.py) on
CPU/gloo: its values and value-loss gradient at TP=2 and at DP=2 equal TP=1's, and TP=1's
equal the torch critic's (trainer/critic.py) on the same trunk weights, head and batch
(tests/integration/scripts/megatron_critic_parity.py, one torchrun per rank count)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import run_logged, run_tiny_model_tool  # noqa: E402

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_critic_parity.py"
# Values and gradients computed by other kernels (megatron-core's local layers vs transformers)
# or other splits (TP=2 sums each attention/MLP product in two halves, then all-reduces) differ
# by float32 rounding only. Each output is a chain of a few hundred roundings (two layers of
# 64-wide dot products, softmax, RMS norms, their backward), so its error is bounded by about
# depth x float32's unit roundoff (6e-8) ~ 1e-5 of the tensor's scale; measured 5e-7 (TP=1 vs
# torch). A wrong head, a missing TP reduction or an untied head counted twice are O(1).
REL = 1e-5

pytestmark = [pytest.mark.slow, NEEDS_MEGATRON]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_critic")
    model = run_tiny_model_tool(root / "model")
    # one torchrun per rank count, its layouts in turn (script_result.each_layout)
    layouts = {1: [("tp1", 1, ["--torch"])], 2: [("tp2", 2, []), ("dp2", 1, [])]}
    for ranks, runs_here in layouts.items():
        args = [a for i, (name, tp, flags) in enumerate(runs_here)
                for a in [*(["+"] if i else []), "--model-dir", str(model), "--tp", str(tp),
                          "--out", str(root / name), *flags]]
        log = root / f"ranks{ranks}.log"
        rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", str(ranks), str(SCRIPT), *args], log, 900)
        assert rc == 0, log.read_text()[-6000:]
    return {name: root / name for name in ("tp1", "tp2", "dp2")}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    assert scale > 0, what  # a zero tensor would compare nothing
    gap = (got - want).abs().max().item()
    assert gap <= REL * scale, f"{what}: gap {gap:.3g} > {REL} x scale {scale:.3g}"


def compare(a: Path, b: Path, b_values: str, b_grads: str) -> None:
    va, vb = torch.load(a / "values.pt"), torch.load(b / b_values)
    mask = va["weights"] != 0
    for key in ("old_values", "returns", "advantages"):
        close(va[key][mask], vb[key][mask], key)
    ga, gb = load_file(str(a / "grads.safetensors")), load_file(str(b / b_grads))
    assert sorted(ga) == sorted(gb)
    for k in gb:
        close(ga[k], gb[k], k)


def metrics(run: Path) -> dict:
    """`update`'s metrics in one layout's run."""
    return json.loads((run / "result.json").read_text())["metrics"]


def assert_same_metrics(got: Path, want: Path) -> None:
    """Two layouts' `update` metrics: the same loss, values, returns and grad norm."""
    m_got, m_want = metrics(got), metrics(want)
    for key in ("critic/vf_loss", "critic/values_mean", "critic/returns_mean",
                "critic/grad_norm"):
        assert m_got[key] == pytest.approx(m_want[key], rel=REL), key


@pytest.mark.timeout(900)
def test_megatron_critic_matches_the_torch_critic(runs):
    """The same trunk weights and head: the values (hence GAE and whitening) and the value
    loss's gradient in every parameter, the head's included, match the torch critic's."""
    compare(runs["tp1"], runs["tp1"], "torch_values.pt", "torch_grads.safetensors")
    torch_grads = load_file(str(runs["tp1"] / "torch_grads.safetensors"))
    torch_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in torch_grads.values())).item()
    assert metrics(runs["tp1"])["critic/grad_norm"] == pytest.approx(torch_norm, rel=REL)


@pytest.mark.timeout(900)
def test_megatron_critic_at_tp2_equals_tp1(runs):
    """TP=2 (the trunk split over two ranks, the head whole on both): the same values and the
    same gradients, gathered under HF names, and the same loss and grad norm (the norm counts
    the head once: it is a TP replica, not a shard)."""
    compare(runs["tp2"], runs["tp1"], "values.pt", "grads.safetensors")
    assert_same_metrics(runs["tp2"], runs["tp1"])
    assert metrics(runs["tp1"])["critic/grad_norm"] > 0


@pytest.mark.timeout(900)
def test_megatron_critic_at_dp2_equals_one_rank(runs):
    """DP=2, each rank with half the rows: the whitening's moments summed over the
    data-parallel group and the gradients averaged by Megatron DDP give the one-rank values,
    advantages and gradients (and the metrics summed over ranks the one-rank metrics)."""
    compare(runs["dp2"], runs["tp1"], "values.pt", "grads.safetensors")
    assert_same_metrics(runs["dp2"], runs["tp1"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["tp1", "tp2", "dp2"])
def test_megatron_critic_resumes_exactly_from_its_dist_checkpoint(runs, name):
    """The critic (model and Adam state, TP-sharded at TP=2) is in the policy's
    dist-checkpoint: loaded back, its values are the saved ones, and the next whole step
    (values, GAE, policy step, critic step) repeats bit for bit. A checkpoint of a run without
    a critic loads the policy and leaves the critic as it was."""
    r = json.loads((runs[name] / "result.json").read_text())["resume"]
    assert r["critic_saved"] and r["restored_equal"] and r["step_moved_it"], r
    assert r["values_equal"]
    assert r["no_critic_left_alone"]  # a checkpoint without a critic leaves it as it was
    a, b = r["metrics"]
    assert a == b and a["critic/vf_loss"] > 0
