"""The megatron backend on CPU/gloo (megatron-core 0.16 + megatron-bridge, through
relax_slurm/trainer/megatron/cpu_compat.py): the tiny HF Qwen3 built through the bridge at
TP=1, TP=2 and PP=2, DP=2 with either optimizer, and a tiny Qwen3-MoE at EP=1 and EP=2
(tests/integration/scripts/megatron_parity.py, one torchrun per rank count)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import (  # noqa: E402
    REPO_ROOT, child_env, run_logged, run_tiny_model_tool,
)

from tests.conftest import NEEDS_MEGATRON  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT = SCRIPTS / "megatron_parity.py"

pytestmark = [
    pytest.mark.slow,
    NEEDS_MEGATRON,
]


def torchrun(ranks: int, script_args: list[str], log: Path, timeout_s: float) -> int:
    """`torchrun --standalone` of a script on `ranks` ranks, output to `log`; its exit code."""
    return run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", str(ranks), *script_args], log, timeout_s)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = run_tiny_model_tool(tmp_path_factory.mktemp("megatron") / "model")
    # a RoPE base other than the default 10000 (real Qwen3: 1e6), so the logits comparison
    # catches a bridge that drops it: megatron-bridge 0.3.1 reads `rope_theta`, which
    # transformers 5 keeps in `rope_parameters` (relax_slurm/trainer/megatron/model.py rope_theta)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 1e6
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def parity_runs(root: Path, layouts) -> dict[str, Path]:
    """Every layout (name, model dir, ranks, TP, PP, EP[, extra script flags]) into root/name
    (result.json, grads and trained weights): one torchrun per rank count, running its layouts
    one after another (script_result.each_layout: one start of megatron for all of them)."""
    out: dict[str, Path] = {}
    argv: dict[int, list[str]] = {}
    for name, model_dir, ranks, tp, pp, ep, *flags in layouts:
        out[name] = root / name
        args = argv.setdefault(ranks, [])
        args += [*(["+"] if args else []), "--model-dir", str(model_dir), "--tp", str(tp),
                 "--pp", str(pp), "--ep", str(ep), "--out", str(out[name]), *flags]
    for ranks, args in argv.items():
        log = root / f"ranks{ranks}.log"
        rc = torchrun(ranks, [str(SCRIPT), *args], log, timeout_s=900)
        assert rc == 0, log.read_text()[-6000:]
    return out


@pytest.fixture(scope="module")
def moe_dir(tiny_dir, tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (4 experts, top-2; transformers writes one tensor per expert, the
    layout megatron-bridge reads)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_dir = tmp_path_factory.mktemp("megatron_moe") / "model"
    config = Qwen3MoeConfig(
        vocab_size=18, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        router_aux_loss_coef=0.0,  # no load-balancing term: EP=2 (DP=2) then equals EP=1
        tie_word_embeddings=True, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        bos_token_id=None)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            (model_dir / f.name).write_bytes(f.read_bytes())
    return model_dir


@pytest.fixture(scope="module")
def runs(tiny_dir, moe_dir, tmp_path_factory) -> dict[str, Path]:
    """Every parity layout of this module, run once. The tiny model at TP=1, TP=2 and PP=2
    (tp2 writes its checkpoint asynchronously, and a sync one to compare; tp2 recomputes every
    layer in the backward and pp2 the core attention (trainer.recompute), and both compute the
    log-probs over chunks of positions (trainer.logprob_chunk_size; tp2's chunks hold TP
    reductions, run again in the backward): the same gradients as tp1, which keeps them and
    computes the whole sequence at once); DP=2 with Megatron's optimizer and with its
    distributed optimizer; the tiny MoE at EP=1 on one rank and EP=2 on two (DP=2)."""
    return parity_runs(tmp_path_factory.mktemp("megatron_runs"), (
        ("tp1", tiny_dir, 1, 1, 1, 1),
        ("tp2", tiny_dir, 2, 2, 1, 1, "--async-save", "--recompute", "full",
         "--logprob-chunk-size", "4"),
        ("pp2", tiny_dir, 2, 1, 2, 1, "--recompute", "selective", "--logprob-chunk-size", "3"),
        ("dp2", tiny_dir, 2, 1, 1, 1), ("dp2_distopt", tiny_dir, 2, 1, 1, 1, "--dist-opt"),
        ("ep1", moe_dir, 1, 1, 1, 1), ("ep2", moe_dir, 2, 1, 1, 2)))


def result(d: Path) -> dict:
    return json.loads((d / "result.json").read_text())


def tp_pp(runs: dict[str, Path]) -> dict[str, Path]:
    """The tiny dense model's TP and PP layouts (the DP and MoE ones have tests of their own)."""
    return {k: runs[k] for k in ("tp1", "tp2", "pp2")}


@pytest.mark.timeout(1200)
def test_bridge_export_equals_hf_bitwise(runs, tiny_dir):
    hf = load_file(str(tiny_dir / "model.safetensors"))
    for name, d in tp_pp(runs).items():
        r = result(d)
        assert r["exported_names"] == sorted(hf), name  # tied lm_head exported once, as HF saves
        assert r["export_bitwise"], name


@pytest.mark.timeout(1200)
def test_tp2_forward_backward_equals_tp1(runs):
    one, two = result(runs["tp1"]), result(runs["tp2"])
    # logits against the transformers model (different kernels: float32 rounding only)
    assert one["logits_max_diff"] < 1e-5 and two["logits_max_diff"] < 1e-5
    g1, g2 = load_file(str(runs["tp1"] / "grads.safetensors")), load_file(
        str(runs["tp2"] / "grads.safetensors"))
    assert sorted(g1) == sorted(g2)
    for k in g1:
        # same weights, same batch: gradients equal up to the order of float32 sums
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7, msg=k)
    # step 0 runs on the same weights: loss and norm equal up to the order of float32 sums;
    # every TP shard counted once in the norm (clipping sees the whole gradient)
    (a0, a1), (b0, b1) = one["steps"], two["steps"]
    assert a0["train/loss"] == pytest.approx(b0["train/loss"], rel=1e-5)
    assert a0["train/grad_norm"] == pytest.approx(b0["train/grad_norm"], rel=1e-5)
    # step 1 runs on weights that differ: Adam's first update is lr * g / (|g| + eps), which
    # turns the rounding-level gradient difference of a component with |g| ~ eps into a weight
    # difference up to lr (a relative 1e-5 on the loss failed once at 1.7e-5). Bound the loss
    # gap by the mean-value theorem: |dL| <= |grad L| * |dw| (Cauchy-Schwarz), with dw that
    # Adam update computed from the two layouts' own step-0 gradients, x2 for the second-order
    # term, plus the step-0 rounding allowance.
    lr, adam_eps = 1e-2, 1e-8  # megatron_parity.py's TrainerConfig, megatron-core's default eps
    dw = sum(float(((g2[k] / (g2[k].abs() + adam_eps) - g1[k] / (g1[k].abs() + adam_eps))
                    * lr).square().sum()) for k in g1) ** 0.5
    bound = 2 * max(a1["train/grad_norm"], b1["train/grad_norm"]) * dw
    assert abs(a1["train/loss"] - b1["train/loss"]) <= bound + 1e-5 * abs(a1["train/loss"])


@pytest.mark.timeout(1200)
def test_several_optimizer_steps_per_batch_equal_those_steps_by_hand(runs):
    """trainer.num_steps_per_rollout=2 under megatron: at TP=1 and TP=2 the old log-probs and
    the two updates equal the steps written out by hand bitwise (same kernels, same order);
    every layout's old log-probs (PP=2: through the pipeline's forward-only schedule) equal
    TP=1's up to float32 rounding of the logits (same weights: the order of sums)."""
    ref = result(runs["tp1"])["mini_batches"]
    for name, d in tp_pp(runs).items():
        r = result(d)["mini_batches"]
        assert r["moved"] and r["lr_steps"] == 1, name
        assert r.get("old_equal_by_hand", True) and r.get("equal_by_hand", True), name
        assert r["old_logp_sum"] == pytest.approx(ref["old_logp_sum"], rel=1e-5), name
    assert "old_equal_by_hand" in ref and "equal_by_hand" in ref


@pytest.mark.timeout(1200)
def check_reference(r: dict) -> None:
    """megatron_parity.py's reference_check: the KL reference sharded as the policy."""
    ref = r["reference"]
    # the logits agree with transformers' within 1e-5 (above); a log-softmax moves by at most
    # twice its logits' largest change
    assert ref["vs_transformers_max_diff"] < 2e-5, ref
    assert ref["differs_from_policy"], ref  # model.path, while the policy has trained
    # a refresh copies the shards: the same kernels on the same weights, bit for bit; and a
    # checkpoint keeps them
    assert ref["refreshed_equals_policy"] and ref["loaded_equals_refreshed"], ref


def test_sharded_reference_scores_as_transformers_refreshes_and_resumes(runs):
    for d in tp_pp(runs).values():
        check_reference(result(d))


def test_pp2_trains_like_pp1(runs):
    one, pp = result(runs["tp1"]), result(runs["pp2"])
    for a, b in zip(one["steps"], pp["steps"]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    w1, w2 = load_file(str(runs["tp1"] / "trained.safetensors")), load_file(
        str(runs["pp2"] / "trained.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=k)


CONVERTED = ("tp2", "pp2", "ep2", "dp2_distopt")  # the layouts whose checkpoint is converted
CONVERT_EACH = """
import sys
from pathlib import Path
from relax_slurm.checkpoint.cli import main
root = Path(sys.argv[1])
sys.exit(max(main(["--input", str(root / n / "checkpoints"), "--output", str(root / n / "hf")])
             for n in sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def converted(runs) -> dict[str, Path]:
    """relax-convert of each CONVERTED layout's checkpoints directory into its run's hf/: it
    detects the Megatron dist-checkpoint and writes HF through the bridge, resharded to one
    rank. One Python for the four (megatron imported once); relax-convert's command line is
    main's argv."""
    root = runs["tp2"].parent
    assert all(runs[n].parent == root for n in CONVERTED)
    proc = subprocess.run([sys.executable, "-c", CONVERT_EACH, str(root), *CONVERTED],
                          env=child_env(), cwd=str(REPO_ROOT), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {n: runs[n] / "hf" for n in CONVERTED}


def check_resumed_and_converted(run: Path, out: Path) -> None:
    """The run's checkpoint resumed exactly (megatron_parity.py), and relax-convert's HF files
    in `out` (the `converted` fixture) are the trained weights, bit for bit."""
    r = result(run)["resume"]
    assert r["extra"] == {"marker": 7, "step": 2, "lr_steps_done": 2}
    assert r["weights_restored"] and r["next_step_equal"], r
    trained = load_file(str(run / "trained.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(trained)
    for k in trained:
        assert torch.equal(converted[k], trained[k]), k
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_dist_checkpoint_resumes_and_converts_to_hf(runs, converted, layout):
    check_resumed_and_converted(runs[layout], converted[layout])


def dcp_entries(ckpt: Path, tmp: Path) -> dict:
    """Every entry of a Megatron dist-checkpoint (torch DCP underneath), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(1200)
def test_async_save_equals_sync_save(runs, tmp_path):
    """The tp2 run saved step 2 both ways, then trained a step while the async writer ran: the
    async checkpoint holds the state at the save (model and optimizer, every shard), bit for
    bit the sync one's, and was committed only when waited for. (It resumes and converts:
    test_dist_checkpoint_resumes_and_converts_to_hf[tp2].)"""
    run = runs["tp2"]
    assert result(run)["committed_while_training"] is False
    # megatron-core's write-results queue is served by a forked process (~0.04 CPU-s by the
    # end): a spawned one (its default) imports the script's torch and megatron again, 1.8-2.5
    # CPU-s at each rank's first save
    assert result(run)["results_manager_cpu_s"] < 0.5, result(run)["results_manager_cpu_s"]
    sync = dcp_entries(run / "checkpoints_sync" / "step_2", tmp_path)
    asyn = dcp_entries(run / "checkpoints" / "step_2", tmp_path)
    assert sorted(asyn) == sorted(sync)
    assert sum(k.startswith("optimizer.state.") for k in sync) > 10
    for k, v in sync.items():
        assert torch.equal(asyn[k], v) if isinstance(v, torch.Tensor) else asyn[k] == v, k
    meta = [json.loads((run / d / "step_2" / "meta.json").read_text())
            for d in ("checkpoints", "checkpoints_sync")]
    assert meta[0]["extra_state"] == meta[1]["extra_state"]


@pytest.mark.timeout(600)
def test_async_save_killed_before_commit_is_not_a_checkpoint(tiny_dir, tmp_path):
    from relax_slurm.checkpoint import find_latest
    from relax_slurm.trainer.megatron.checkpoint import is_megatron_checkpoint

    root, log = tmp_path / "checkpoints", tmp_path / "torchrun.log"
    rc = torchrun(1, [str(SCRIPTS / "megatron_kill_async_save.py"), "--model-dir",
                      str(tiny_dir), "--root", str(root)], log, timeout_s=500)
    assert rc != 0 and (tmp_path / "scheduled").exists(), log.read_text()[-4000:]
    # the killed rank's session (its own: torchrun's doing) still holds the forked writer
    rank = int((tmp_path / "scheduled").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.killpg(rank, signal.SIGKILL)
    latest = find_latest(tmp_path)
    assert latest is not None and latest.name == "step_1" and is_megatron_checkpoint(latest)
    assert not (root / "step_2").exists() and not (root / "step_2.tmp" / "meta.json").exists()


@pytest.mark.timeout(1200)
def test_moe_expert_parallel_equals_one_rank(runs, converted):
    one, two = result(runs["ep1"]), result(runs["ep2"])
    for r in (one, two):  # experts gathered across EP ranks: the HF checkpoint, bit for bit
        assert r["exported_names"] == r["hf_names"] and r["export_bitwise"]
        assert r["logits_max_diff"] < 1e-5
        check_reference(r)  # its experts sharded over the EP ranks as the policy's
    g1, g2 = (load_file(str(runs[k] / "grads.safetensors")) for k in ("ep1", "ep2"))
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7, msg=k)
    for a, b in zip(one["steps"], two["steps"]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    check_resumed_and_converted(runs["ep2"], converted["ep2"])


@pytest.mark.timeout(1200)
def test_distributed_optimizer_equals_plain_and_resumes(runs, converted):
    plain, sharded = result(runs["dp2"]), result(runs["dp2_distopt"])
    for a, b in zip(plain["steps"], sharded["steps"]):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
        # the sharded grad norm sums the squares of each rank's shard: float32 order only
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    w1, w2 = (load_file(str(runs[k] / "trained.safetensors"))
              for k in ("dp2", "dp2_distopt"))
    assert sorted(w1) == sorted(w2)
    for k in w1:
        # same reduced gradients, the same elementwise Adam on each shard (measured: bitwise
        # equal after two steps; the tolerance allows the reduce-scatter's float32 sum order)
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-6, atol=1e-8, msg=k)
    # its dist-checkpoint (optimizer state gathered per parameter) resumes exactly, and converts
    check_resumed_and_converted(runs["dp2_distopt"], converted["dp2_distopt"])
