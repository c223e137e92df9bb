"""model.lora under trainer=megatron (relax_slurm/trainer/megatron/lora.py, issue #37):
megatron-bridge's CanonicalLoRA at TP=2, at TP=1 x DP=2, at EP=2 on the tiny Qwen3-MoE
(attention and lm_head adapted, the experts frozen) and at DP=2 with the distributed optimizer,
on gloo against PEFT on the transformers model (trainer=torch's LoRA,
relax_slurm/trainer/lora.py), from the same nonzero adapter: the first step's loss and every
adapter gradient under PEFT's names, the adapter's round trip PEFT -> megatron -> PEFT, the
merged export, frozen base weights, the adapters disabled as the reference, and the adapter
one real Adam step leaves, equal under the plain and the distributed optimizer.
One two-rank torchrun runs the five layouts in turn (tests/integration/scripts/
megatron_lora_parity.py; ~7.5 CPU-s of each rank's start shared by all). And `relax-train experiment=tiny_cpu trainer=megatron model.lora.rank=8` at
TP=2 with the distributed optimizer end to end: adapter-only syncs, the reference as the
adapters disabled, exact resume, and its checkpoint through relax-convert to a PEFT adapter
and to a merged HF model (~35-45 s; the conversions and their checks run beside the resumed
run)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_moe import make_moe_model  # noqa: E402
from helpers_tiny import (child_env, run_logged, run_tiny_model_tool,  # noqa: E402
                          stop_process)

from tests.conftest import NEEDS_MEGATRON, relax_train  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "megatron_lora_parity.py"
# experiment=tiny_cpu's LoRA targets: every projection, and lm_head (tied to the embeddings)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "lm_head"]
# on an MoE model the MLP targets are its routed experts, which trainer=megatron refuses
# (megatron/lora.py check_no_expert_targets): attention and lm_head (tied here too); k_proj
# left out, so that a part of the fused q/k/v is adapted (and merged: megatron/lora.py
# _fix_library) somewhere in these tests
MOE_TARGETS = ["q_proj", "v_proj", "o_proj", "lm_head"]
# and at DP=2 gate_proj without up_proj (the other fused layer in part)
DP_TARGETS = [t for t in TARGETS if t != "up_proj"]
RANK, ALPHA, MICRO_BATCH = 8, 16.0, 3
# the parity layouts, two ranks each: (model kind, TP, EP, PP, distributed optimizer,
# targets); the last three also check their checkpoint's exact resume
# (megatron_lora_parity.py --resume)
LAYOUTS = {"tp2": ("text", 2, 1, 1, False, TARGETS), "dp2": ("text", 1, 1, 1, False, DP_TARGETS),
           "ep2": ("moe", 1, 2, 1, False, MOE_TARGETS),
           "dp2_distopt": ("text", 1, 1, 1, True, DP_TARGETS),
           "pp2": ("text", 1, 1, 2, False, TARGETS)}
RESUME_CHECKED = ("ep2", "dp2_distopt", "pp2")

pytestmark = [pytest.mark.slow, NEEDS_MEGATRON]


def lora_model_cfg(model_dir: Path, targets: list[str] = TARGETS):
    from relax_slurm.config.model import LoraConfig, ModelConfig

    return ModelConfig(path=str(model_dir), lora=LoraConfig(rank=RANK, alpha=ALPHA,
                                                            target_modules=list(targets)))


def peft_policy(model_dir: Path, targets: list[str] = TARGETS):
    """trainer=torch's LoRA policy: PEFT's model on the transformers model, float32."""
    from transformers import AutoModelForCausalLM

    from relax_slurm.trainer.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return apply_lora(model, lora_model_cfg(model_dir, targets))


def nonzero_adapter(policy, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every A and B set from N(0, 0.05^2) (B nonzero: the gradient reaches A too); the
    adapter under PEFT's saved names, as trainer=torch's adapter_of yields it."""
    from relax_slurm.trainer.lora import adapter_of

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return adapter_of(policy).tensors


def batch_tensors(vocab: int, rows: int = 6, width: int = 9) -> dict[str, torch.Tensor]:
    """A fixed batch; micro-batches of 3 rows x 9 tokens: an odd token count, which megatron-
    bridge's own q/k/v interleave at TP=2 could not reshape (lora.py _fix_library)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (rows, width), generator=g)
    weights = torch.zeros(rows, width - 1)
    weights[:, 3:] = 1.0 / (rows * (width - 4))
    return {"batch.input_ids": ids, "batch.attention_mask": torch.ones_like(ids),
            "batch.targets": ids[:, 1:].contiguous(), "batch.weights": weights,
            "batch.advantages": torch.randn(rows, width - 1, generator=g),
            "batch.rollout_logp": torch.full((rows, width - 1), -1.0)}


def torch_step(policy, tensors: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """trainer=torch's first step on one rank, up to the optimizer: the summed micro-batch
    losses (what train/loss reports) and the adapter's gradients under PEFT's saved names."""
    sys.path.insert(0, str(SCRIPT.parent))
    from megatron_lora_parity import batch_from

    from relax_slurm.config.algo import AlgoConfig
    from relax_slurm.trainer.batch import loss_params
    from relax_slurm.trainer.step import banned_ids, next_token_logits, token_loss, token_terms

    algo, batch = AlgoConfig(), batch_from(tensors)
    policy.train()
    total = 0.0
    for lo in range(0, len(batch), MICRO_BATCH):
        mb = batch.rows(lo, lo + MICRO_BATCH)
        logp, entropy = token_terms(next_token_logits(policy, mb), mb.targets, 1.0,
                                    banned_ids(policy), "metric")
        loss, _ = token_loss(logp, entropy, mb, algo, loss_params(algo), None)
        loss.backward()
        total += float(loss.detach())
    grads = {n.replace(".default", ""): p.grad.detach().clone()
             for n, p in policy.named_parameters() if p.requires_grad}
    return total, grads


@pytest.fixture(scope="module")
def every_layout(tmp_path_factory) -> dict[str, dict]:
    """LAYOUTS' runs (TP=2; TP=1 with two data-parallel ranks, half the rows each; EP=2 on the
    tiny MoE, DP=2 for its attention; DP=2 with the distributed optimizer; PP=2, two stages),
    and the torch PEFT trainer's first step on the same adapter and batch, by layout: every
    layout one after another in one two-rank torchrun (script_result.each_layout), one start
    of megatron for the five. A failed launch fails every test of the module at once: pytest
    keeps a module fixture's error."""
    return _run_every_layout(tmp_path_factory)


def _run_every_layout(tmp_path_factory) -> dict[str, dict]:
    from relax_slurm.trainer.lora import merged_parameters

    prepared, argv, runs = {}, [], {}
    for layout, (kind, tp, ep, pp, dist_opt, targets) in LAYOUTS.items():
        root = tmp_path_factory.mktemp(f"megatron_lora_{layout}")
        model_dir = (make_moe_model if kind == "moe" else run_tiny_model_tool)(root / "model")
        policy = peft_policy(model_dir, targets)
        adapter = nonzero_adapter(policy)
        tensors = batch_tensors(policy.config.vocab_size)
        save_file({**adapter, **tensors}, str(root / "inputs.safetensors"))
        prepared[layout] = (root / "out", model_dir, policy, adapter, tensors)
        argv += [*(["+"] if argv else []), "--model-dir", str(model_dir),
                 "--tp", str(tp), "--ep", str(ep), "--pp", str(pp),
                 *(["--dist-opt"] if dist_opt else []),
                 *(["--resume"] if layout in RESUME_CHECKED else []),
                 "--rank", str(RANK), "--alpha", str(ALPHA),
                 "--targets", ",".join(targets), "--micro-batch-size", str(MICRO_BATCH),
                 "--inputs", str(root / "inputs.safetensors"), "--out", str(root / "out")]
    log = tmp_path_factory.mktemp("megatron_lora") / "torchrun.log"
    rc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", str(SCRIPT), *argv], log, timeout_s=900)
    assert rc == 0, log.read_text()[-6000:]
    for layout, (out, model_dir, policy, adapter, tensors) in prepared.items():
        kind, tp, ep, pp, dist_opt, _ = LAYOUTS[layout]
        merged = {k: v.clone() for k, v in merged_parameters(policy)}
        loss, grads = torch_step(policy, tensors)
        runs[layout] = {
            "layout": layout, "tp": tp, "ep": ep, "pp": pp, "dist_opt": dist_opt,
            "model_dir": model_dir,
            "merged": merged, "megatron_merged": load_file(str(out / "merged.safetensors")),
            "adapter": adapter, "batch": tensors, "loss": loss, "grads": grads,
            "result": json.loads((out / "result.json").read_text()),
            "exported": load_file(str(out / "exported.safetensors")),
            "megatron_grads": load_file(str(out / "grads.safetensors")),
            "stepped": load_file(str(out / "stepped.safetensors"))}
    return runs


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parity(request, every_layout):
    return every_layout[request.param]


@pytest.mark.timeout(600)
def test_adapter_round_trips_bit_for_bit(parity):
    adapter, exported = parity["adapter"], parity["exported"]
    assert sorted(exported) == sorted(adapter)
    for name, t in adapter.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


@pytest.mark.timeout(600)
def test_merged_export_is_peft_merge(parity):
    """The bridge's HF export of the adapted model (a merged sync, save_hf) against PEFT's
    merge W + alpha / r * B @ A (trainer/lora.py merged_parameters): the same float32 products,
    perhaps summed in another order (measured: bitwise; bound 16 eps of the weight's scale).
    The adapter on the tied lm_head is in neither (no lm_head weight of its own: merged
    weights refuse it, lora.py check_mergeable), so the embeddings stay model.path's in both."""
    eps = torch.finfo(torch.float32).eps
    ours, peft = parity["megatron_merged"], parity["merged"]
    if parity["ep"] > 1:
        # the MoE's experts, frozen: transformers 5 holds them fused (mlp.experts.gate_up_proj
        # [E, 2I, H]), the bridge exports them per expert as model.safetensors stores them,
        # gathered over the EP ranks: each model.path's exactly
        original = load_file(str(parity["model_dir"] / "model.safetensors"))
        experts = {n for n in original if ".mlp.experts." in n}
        assert experts and all(torch.equal(ours.pop(n), original[n]) for n in experts)
        peft = {n: w for n, w in peft.items() if ".mlp.experts." not in n}
    assert set(peft) <= set(ours) and set(ours) - set(peft) <= {"lm_head.weight"}  # tied
    for name, w in peft.items():
        torch.testing.assert_close(ours[name], w, rtol=0, atol=16 * eps * float(w.abs().max()),
                                   msg=name)
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"],
                           load_file(str(parity["model_dir"] / "model.safetensors"))[
                               "model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.timeout(600)
def test_only_adapters_train(parity):
    r = parity["result"]
    assert r["frozen_not_adapter"] and r["frozen_have_no_grad_buffer"]
    assert r["base_unchanged"] and r["base_grads_none"]
    assert r["trainable"] and all(".adapter." in n for n in r["trainable"])
    # the optimizer holds this rank's adapter shards and nothing else: half of every adapter
    # at TP=2, all of it at TP=1; the distributed optimizer a part of it on each DP rank,
    # together all of it once
    total = sum(t.numel() for t in parity["adapter"].values())
    # (counted over the pipeline stages: each holds its own layers' adapters)
    assert r["tp_size"] == parity["tp"] and r["pp_size"] == parity["pp"]
    assert r["dp_size"] == 2 // (parity["tp"] * parity["pp"])
    assert r["ep_size"] == parity["ep"]
    assert r["local_adapter_params"] == total // parity["tp"]
    assert (r["optimizers"] == ["DistributedOptimizer"]) == parity["dist_opt"], r["optimizers"]
    if parity["dist_opt"]:
        assert 0 < r["optimizer_params"] < total and r["optimizer_params_dp_sum"] == total
    else:
        assert r["optimizer_params"] == total // parity["tp"]


@pytest.mark.timeout(600)
def test_adapter_disabled_is_the_base_model(parity):
    r = parity["result"]
    # megatron's local layers against transformers' kernels, log-probs by Megatron's
    # forward-only schedule (pipelined at PP=2): float32 rounding of the same function
    # (test_megatron_parallel.py's bound for the logits)
    assert r["disabled_logprobs_max_diff"] < 1e-5
    assert r["enabled_differs_by"] > 1e-2  # the nonzero adapter is on otherwise


@pytest.mark.timeout(600)
def test_first_step_loss_and_adapter_grads_match_peft(parity):
    """Same weights, same adapter, same batch, both float32: only the order of float32 sums
    can differ. At TP=2 megatron splits the reductions of the row-parallel layers (and of A on
    them) over the two ranks and adds the halves in a gloo all-reduce; at DP=2 each rank's
    gradient covers half the rows and Megatron DDP adds the two; in both it runs q/k/v and
    gate/up fused and its own attention kernel against transformers' SDPA. A sum's rounding
    error scales with the magnitude of its terms, not of its result, so each gradient tensor
    is bounded by a multiple of float32's eps times its own largest entry: 64 eps. Measured: at
    most 8.2 eps at TP=2, 8.0 at DP=2 (7.0 without up_proj, with either optimizer) and 4.7 at
    EP=2 (most tensors 1-4 eps), so 64 leaves ~8x for other
    CPUs' kernels and thread counts; a wrong layout or scale is off by O(1). The loss likewise
    against the magnitude of its terms, sum(w |A|) (~0.86 here): measured 6.5e-9 (TP=2) and
    3.7e-9 (DP=2), under 0.1 eps of it; bound 64 eps of it (6.6e-6), against the 8e-4 by which
    this adapter moves the loss (through the truncated importance weights)."""
    eps = torch.finfo(torch.float32).eps
    loss, grads, mg = parity["loss"], parity["grads"], parity["megatron_grads"]
    terms = float((parity["batch"]["batch.weights"] * parity["batch"]["batch.advantages"].abs()
                   ).sum())
    assert abs(parity["result"]["loss"] - loss) <= 64 * eps * terms
    assert sorted(mg) == sorted(grads)
    for name, g in grads.items():
        scale = float(g.abs().max())
        assert scale > 0, name  # B nonzero: A gets a gradient too
        torch.testing.assert_close(mg[name], g, rtol=0, atol=64 * eps * scale, msg=name)


@pytest.mark.timeout(900)
def test_distributed_optimizer_steps_the_adapter_as_the_plain_one(every_layout):
    """One real Adam step (Megatron's optimizer, trainer.lr 1e-2) from the same adapter on the
    same reduced gradients at DP=2: the distributed optimizer shards the adapters' state over
    the two ranks, steps each shard and all-gathers the parameters; the plain one steps all of
    it on each rank. Both run the same elementwise Adam on the same gradients (equal within
    the float32 order of the reduce-scatter against the all-reduce, the first test's bound),
    so the adapters they leave agree to float32 rounding of the update (measured: bitwise);
    and the step moved every tensor (a shard left out would stay at the loaded adapter)."""
    plain, sharded = every_layout["dp2"], every_layout["dp2_distopt"]
    assert plain["result"]["step_ok"] and sharded["result"]["step_ok"]
    assert sharded["result"]["step_grad_norm"] == pytest.approx(
        plain["result"]["step_grad_norm"], rel=1e-6)
    a, b = plain["stepped"], sharded["stepped"]
    assert sorted(a) == sorted(b) == sorted(plain["adapter"])
    for name, t in a.items():
        assert not torch.equal(t, plain["adapter"][name]), name  # the step moved it
        torch.testing.assert_close(b[name], t, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", RESUME_CHECKED)
def test_adapter_checkpoint_resumes_exactly(layout, every_layout):
    """The trainer's adapter-only dist-checkpoint after one real step, at EP=2 (the MoE's
    experts frozen, not saved) and with the distributed optimizer at DP=2 (Adam's state of the
    adapters sharded over the two ranks): one more step from it repeats the step taken before
    the load bit for bit (loss, grad norm, every adapter tensor), and the checkpoint holds
    adapter keys only. (The end-to-end run below resumes a whole run exactly at TP=2.)"""
    r = every_layout[layout]["result"]
    assert r["resume_checkpoint_keys_adapter_only"]
    assert r["resume_moved"]  # the step after the save changed every adapter tensor
    assert r["resume_steps_done"] == [2, 2]  # the lr schedule's position came back too
    assert r["resume_exact"]


# ---- end to end: relax-train experiment=tiny_cpu trainer=megatron model.lora.rank=8 --------

E2E_STEPS, E2E_RESUME_AT = 6, 4

# where each PEFT module's adapter lives in a trainer=megatron checkpoint (CanonicalLoRA's
# adapters, keyed with the layers stacked along dim 0): this test's own reading of the layout,
# against which relax-convert's (the bridge's adapter export) is checked
MEGATRON_ADAPTER_OF = {
    "self_attn.q_proj": "self_attention.linear_qkv.adapter.adapter_q",
    "self_attn.k_proj": "self_attention.linear_qkv.adapter.adapter_k",
    "self_attn.v_proj": "self_attention.linear_qkv.adapter.adapter_v",
    "self_attn.o_proj": "self_attention.linear_proj.adapter",
    "mlp.gate_proj": "mlp.linear_fc1.adapter.adapter_gate",
    "mlp.up_proj": "mlp.linear_fc1.adapter.adapter_up",
    "mlp.down_proj": "mlp.linear_fc2.adapter",
}
CONVERT_BOTH = """
import sys
from relax_slurm.checkpoint.cli import main
src, out = sys.argv[1:3]
sys.exit(max(main(["--input", src, "--output", f"{out}/{to}", "--to", to, "--no-progress"])
             for to in ("peft", "hf")))
"""


def megatron_adapter_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a trainer=megatron model.lora checkpoint (Megatron's torch_dist
    format is torch DCP underneath), keyed as megatron names them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if ".adapter." in k and not k.startswith("optimizer") and hasattr(m, "size")}
    dcp.load(out, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    return out


def peft_adapter_of_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron_adapter_state under PEFT's saved names: linear_in is A, linear_out is B, one
    layer per index of the stacked dim; megatron's output_layer is lm_head."""
    out = {}
    for module, adapter in MEGATRON_ADAPTER_OF.items():
        for peft_ab, megatron_ab in (("lora_A", "linear_in"), ("lora_B", "linear_out")):
            for layer, t in enumerate(state[f"decoder.layers.{adapter}.{megatron_ab}.weight"]):
                out[f"base_model.model.model.layers.{layer}.{module}.{peft_ab}.weight"] = t
    out["base_model.model.lm_head.lora_A.weight"] = state["output_layer.adapter.linear_in.weight"]
    out["base_model.model.lm_head.lora_B.weight"] = state["output_layer.adapter.linear_out.weight"]
    return out


def start_conversions(step_dir: Path, out: Path) -> subprocess.Popen:
    """relax-convert of `step_dir` --to peft (out/peft) and --to hf (out/hf), started in the
    background (it runs beside the resumed run), in one Python: megatron imports once."""
    out.mkdir()
    with open(out / "convert.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-c", CONVERT_BOTH, str(step_dir), str(out)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)


def merge_rounding_bound(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float
                         ) -> torch.Tensor:
    """Per element, how far two float32 merges W + scale * (B @ A) may differ when each sums
    the rank's r products in its own order (another process, thread count or kernel). Each
    one's error, to first order in u = eps / 2: the r-term dot product r u sum_k |B_ik A_kj|,
    the product by scale and the sum with W one rounding each, u scale (|B| @ |A|) and
    u (|W| + scale (|B| @ |A|)); two such differ by twice that:
    eps ((r + 2) scale (|B| @ |A|) + |W|)."""
    eps = torch.finfo(torch.float32).eps
    r = a.shape[0]
    return eps * ((r + 2) * scale * (b.abs() @ a.abs()) + w.abs())


def peft_merge_of(model_dir: Path, adapter_dir: Path):
    """PEFT's own merge of the adapter (merge_and_unload) into model.path, with the head untied
    first as PEFT advises for an adapter on a tied lm_head (its warning's recipe: the model
    loaded untied, the head set to a copy of the embeddings), so the embeddings stay."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                tie_word_embeddings=False)
    base.lm_head.weight.data = base.model.embed_tokens.weight.data.clone()
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def check_converted_adapter(state: dict[str, torch.Tensor], out: Path, model_dir: Path
                            ) -> None:
    """relax-convert's two outputs of a trainer=megatron model.lora checkpoint, against the
    adapter as the checkpoint holds it (`state`: megatron_adapter_state, put under PEFT's names
    by this test's own layout table):

    - --to peft: exactly those tensors under PEFT's saved names (a gather, no arithmetic: bit
      for bit), and PEFT loads the directory on model.path with every adapter tensor of its
      model given and no other; its logits are those of trainer=torch's PEFT policy for this
      run's model.lora (test constants, not the written adapter_config.json) holding the
      checkpoint's adapter: the same modules, tensors and scale, so bit for bit too. (The
      trainer's own function of that adapter is PEFT's within float32 rounding: the parity
      tests above, and this run's rollout/train log-prob diff.)
    - --to hf: transformers loads it, and every weight is PEFT's merge_and_unload of the --to
      peft output within merge_rounding_bound (measured: bit for bit, the same PEFT merge);
      the embeddings are model.path's exactly (the adapted tied head merged into a head of its
      own)."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    expected = peft_adapter_of_state(state)
    written = load_file(str(out / "peft" / "adapter_model.safetensors"))
    assert sorted(written) == sorted(expected)
    for name, t in expected.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out / "peft")).eval()
    held = get_peft_model_state_dict(loaded, save_embedding_layers=False)
    assert sorted(held) == sorted(written)  # nothing missing, nothing unexpected
    assert all(torch.equal(held[n], written[n]) for n in held)
    oracle = peft_policy(model_dir).eval()
    result = set_peft_model_state_dict(oracle, expected)
    assert not result.unexpected_keys
    ids = torch.tensor([[3, 4, 13, 5, 14, 9], [6, 7, 13, 8, 14, 2]])
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, oracle(input_ids=ids).logits
        with loaded.disable_adapter():
            base_logits = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    assert (got - base_logits).abs().max() > 1e-3  # the trained adapter is on

    merged = dict(AutoModelForCausalLM.from_pretrained(str(out / "hf"),
                                                       dtype=torch.float32).named_parameters())
    reference = dict(peft_merge_of(model_dir, out / "peft").named_parameters())
    assert sorted(merged) == sorted(reference)
    original = load_file(str(model_dir / "model.safetensors"))
    embeddings = original["model.embed_tokens.weight"]
    for name, want in reference.items():
        module = name.removesuffix(".weight")
        a = written.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:  # not adapted: model.path's own weight, untouched by either merge
            assert torch.equal(merged[name], want), name
            continue
        b = written[f"base_model.model.{module}.lora_B.weight"]
        w = original.get(name, embeddings)  # lm_head: tied, stored as the embeddings
        bound = merge_rounding_bound(w, a, b, ALPHA / RANK)
        assert ((merged[name] - want).abs() <= bound).all(), name
    assert torch.equal(merged["model.embed_tokens.weight"], embeddings)


@pytest.mark.timeout(900)
def test_tiny_lora_on_megatron_tp2_syncs_the_adapter_alone_and_resumes_exactly(tmp_path,
                                                                               tiny_assets):
    """`relax-train experiment=tiny_cpu trainer=megatron algo=ppo model.lora.rank=8` at TP=2
    with the distributed optimizer (over one DP rank here: its code path, state dict and checkpoint
    format; its sharding over two DP ranks and that checkpoint's exact resume are the
    dp2_distopt parity row's), the preset's targets, lm_head too, through the real topology
    with the hf engine serving the adapter: every sync sends the adapter alone (its bytes exactly, a quarter of the model's
    or less), the engine's log-probs are the trainer's, the KL loss's reference is the policy
    with its adapters off (0 exactly at step 0, where B is zero), and the step-4 checkpoint,
    which holds the adapter alone, resumes the last 2 steps exactly; the final checkpoint
    converts to a PEFT adapter and a merged HF model (check_converted_adapter). algo=ppo: the
    critic beside the adapters is the megatron value model of algo=ppo as without LoRA (its
    own full weights from model.path and Adam: trainer/megatron/critic.py, whose parity with
    the torch critic is test_megatron_critic.py's); the checkpoint holds it whole, and the
    resume repeats its metrics exactly too (one run for both: a run each cost ~60 s)."""
    from transformers import AutoConfig

    # one optimizer step per batch (algo=ppo's 4 mini-batches are the other PPO runs'): the
    # engine's log-probs and the reference are then compared with the weights that sampled
    common = ("trainer=megatron", "algo=ppo", "trainer.num_steps_per_rollout=1",
              "model.lora.rank=8", "trainer.nproc_per_node=2",
              "trainer.tensor_parallel_size=2", "trainer.use_distributed_optimizer=true",
              f"trainer.total_steps={E2E_STEPS}",
              f"trainer.save_every={E2E_RESUME_AT}", "algo.kl_loss_coef=0.01",
              "model.lora.lr=1e-2", "metrics.progress=false")

    def train(run_dir: Path, *extra: str) -> list[dict]:
        proc = relax_train(run_dir, tiny_assets, *common, *extra, timeout_s=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    straight = tmp_path / "straight"
    rows = train(straight)
    assert [r["step"] for r in rows] == list(range(E2E_STEPS))
    # the adapter alone on every sync: rank-8 A and B of every targeted linear, float32
    hf = load_file(str(tiny_assets / "model" / "model.safetensors"))
    c = AutoConfig.from_pretrained(tiny_assets / "model")
    q, kv, h, f = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                   c.hidden_size, c.intermediate_size)
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
    expected = 4 * RANK * (c.num_hidden_layers * per_layer + (h + c.vocab_size))
    assert {r["weight_sync/bytes"] for r in rows} == {expected}
    assert 4 * expected <= sum(t.numel() * 4 for t in hf.values())
    # the hf engine applies the synced adapter with PEFT: its log-probs are the trainer's
    assert max(r["train/rollout_train_logprob_diff"] for r in rows) < 1e-5
    kl = [r["train/kl_loss"] for r in rows]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:]), kl
    assert any(r["train/grad_norm"] > 0 for r in rows)
    log = (straight / "logs" / "trainer.log").read_text()
    assert "model.lora: rank 8 adapters on" in log
    assert rows[0]["critic/values_mean"] == 0.0  # the value head starts at 0
    assert any(r["critic/values_mean"] != 0.0 for r in rows[1:])  # and the critic trains
    assert all(r["critic/grad_norm"] > 0 for r in rows)

    ckpt = straight / "checkpoints" / f"step_{E2E_RESUME_AT}"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["backend"] == "megatron"
    assert meta["extra_state"]["lora"]["adapter_config"]["r"] == RANK
    # the adapters and their optimizer state: the frozen base is model.path, not saved
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    policy = [k for k in keys if not k.startswith(("critic", "optimizer"))]
    assert policy and all(".adapter." in k for k in policy), sorted(policy)[:5]
    assert any(k.startswith("critic.decoder.") for k in keys)  # the critic whole

    # relax-convert of the trained adapter, --to peft and --to hf, and the checks of what it
    # writes, while the resumed run goes on in a thread: neither keeps two cores busy
    final, resumed = straight / "checkpoints" / f"step_{E2E_STEPS}", tmp_path / "resumed"
    converting = start_conversions(final, tmp_path / "converted")
    with ThreadPoolExecutor(1) as pool:
        resuming = pool.submit(train, resumed, f"resume={ckpt}")
        try:
            assert converting.wait(timeout=300) == 0, (
                tmp_path / "converted" / "convert.log").read_text()[-4000:]
        finally:
            stop_process(converting)
        a = megatron_adapter_state(final)
        check_converted_adapter(a, tmp_path / "converted", tiny_assets / "model")
        again = resuming.result()

    assert [r["step"] for r in again] == list(range(E2E_RESUME_AT, E2E_STEPS))
    for key in ("rollout/reward_mean", "train/kl_loss", "train/loss", "train/grad_norm",
                "critic/vf_loss", "critic/grad_norm", "critic/values_mean",
                "critic/returns_mean"):
        assert [r[key] for r in again] == [r[key] for r in rows[E2E_RESUME_AT:]], key
    b = megatron_adapter_state(resumed / "checkpoints" / f"step_{E2E_STEPS}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
