"""Rollout routing replay (R3) on the tiny Qwen3-MoE: what the hf engine reports, what the
sample carries, and what the trainer's forward does with it (tests/helpers_moe.py: a bf16
engine and a float32 trainer, whose routers really disagree on some tokens)."""

import base64

import numpy as np
import pytest
import torch

from helpers_moe import LAYERS, MAX_NEW, PROMPTS, TOPK, bf16_routed_batch, make_moe_model
from relax_slurm.errors import ConfigError
from relax_slurm.engines import sglang_api
from relax_slurm.engines.client import parse_generate_item
from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.parsing import parse_sampling_params
from relax_slurm.rollout.sampling import sample_routing
from relax_slurm.routing.hooks import RoutingStats, RoutingTrace, moe_routers, routing_replay
from relax_slurm.routing.shape import (ROUTING_DTYPE, decode_routed_experts,
                                       encode_routed_experts, routing_shape, routing_shape_of)
from relax_slurm.trainer.step import gather_logprobs, scaled_logits


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("tiny_moe") / "model")


# ---- the layout and the wire format (pure) --------------------------------------------------

def test_routing_shape_of_configs():
    moe = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
           "mlp_only_layers": [0], "decoder_sparse_step": 1}
    shape = routing_shape_of(moe)
    assert (shape.layers, shape.topk, shape.experts, shape.moe_layers) == (4, 2, 8, (1, 2, 3))
    assert routing_shape_of({**moe, "mlp_only_layers": [], "decoder_sparse_step": 2}
                            ).moe_layers == (1, 3)
    # transformers 5 saves num_local_experts; multimodal MoE models nest the text decoder
    assert routing_shape_of({"text_config": {"num_hidden_layers": 2, "num_local_experts": 4,
                                             "num_experts_per_tok": 1}}).experts == 4
    assert routing_shape_of({"thinker_config": {"text_config": moe}}).layers == 4
    assert routing_shape_of({"num_hidden_layers": 2, "hidden_size": 64}) is None  # dense


def test_routed_experts_wire_format_round_trip_and_errors():
    shape = routing_shape_of({"num_hidden_layers": 2, "num_experts": 8,
                              "num_experts_per_tok": 2})
    ids = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 8
    text = encode_routed_experts(ids)
    # SGLang's bytes: numpy int32, base64 (sglang.srt.state_capturer.routed_experts)
    assert np.array_equal(np.frombuffer(base64.b64decode(text), dtype=np.int32), ids.ravel())
    flat = decode_routed_experts(text, shape, tokens=5)
    assert flat.dtype == ROUTING_DTYPE and np.array_equal(flat, ids.ravel())
    with pytest.raises(ValueError, match="covers 5 tokens, expected 6"):
        decode_routed_experts(text, shape, tokens=6)
    with pytest.raises(ValueError, match="outside 0..7"):
        decode_routed_experts(encode_routed_experts(ids + 8), shape, tokens=5)
    with pytest.raises(ValueError, match="outside 0..7"):  # below as well as above
        decode_routed_experts(encode_routed_experts(ids - 1), shape, tokens=5)
    with pytest.raises(ValueError, match="whole number of tokens"):
        decode_routed_experts(encode_routed_experts(ids.ravel()[:-1]), shape, tokens=5)
    with pytest.raises(ValueError, match="not base64"):
        decode_routed_experts("not base64!", shape, tokens=5)


# ---- the hf engine ---------------------------------------------------------------------------

def _generate_in_process(engine: HFEngine, routed_start):
    specs = [parse_sampling_params({"max_new_tokens": MAX_NEW, "sampling_seed": 11 + i})
             for i in range(len(PROMPTS))]
    return engine.submit(PROMPTS, specs, [True] * len(PROMPTS), None, None,
                         routed_start).result(timeout=120)


def test_engine_routing_is_the_routing_of_a_plain_forward(moe_dir):
    """float32: the experts the engine reports for every prompt and generated token (left
    padded prefill, then one-token decode steps) are those a plain forward of the whole
    sequence picks."""
    engine = HFEngine(str(moe_dir), None, "float32", "cpu", 64, 1.0, "0", 30.0,
                      return_routed_experts=True)
    engine.start()
    try:
        items = _generate_in_process(engine, routed_start=0)
        tail = _generate_in_process(engine, routed_start=2)  # same seeds: same tokens
    finally:
        engine.shutdown()
    shape = routing_shape(moe_dir)
    for prompt, item, cut in zip(PROMPTS, items, tail):
        res = parse_generate_item(item)
        n = len(prompt) + len(res.output_ids) - 1
        got = sample_routing(res, len(prompt), shape, required=True).reshape(n, LAYERS, TOPK)
        trace = RoutingTrace(batch=1)
        with torch.no_grad(), trace.record(engine.model):
            engine.model(input_ids=torch.tensor([prompt + res.output_ids]))
        want = trace.rows(shape.layers, [n], [0])[0].numpy()
        assert np.array_equal(np.sort(got, -1), np.sort(want, -1))
        # routed_experts_start_len=2: the same rows from position 2 on
        assert cut["output_ids"] == item["output_ids"]
        rest = np.frombuffer(base64.b64decode(cut["meta_info"]["routed_experts"]), np.int32)
        assert np.array_equal(rest.reshape(n - 2, LAYERS, TOPK), got[2:])


def test_engine_without_the_flag_sends_none_and_replay_refuses(moe_dir):
    """As SGLang without --enable-return-routed-experts: the request's flag is ignored; a
    worker that needs the routing (algo.routing_replay) stops with the flag's name."""
    engine = HFEngine(str(moe_dir), None, "float32", "cpu", 64, 1.0, "0", 30.0)
    engine.start()
    try:
        items = _generate_in_process(engine, routed_start=0)
    finally:
        engine.shutdown()
    res = parse_generate_item(items[0])
    assert "routed_experts" not in items[0]["meta_info"] and res.routed_experts is None
    shape = routing_shape(moe_dir)
    assert sample_routing(res, len(PROMPTS[0]), shape, required=False) is None
    with pytest.raises(ConfigError, match=sglang_api.ROUTED_EXPERTS_FLAG):
        sample_routing(res, len(PROMPTS[0]), shape, required=True)


def test_engine_refuses_the_flag_for_a_dense_model(tiny_model_dir):
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        HFEngine(str(tiny_model_dir), None, "float32", "cpu", 64, 1.0, "0", 30.0,
                 return_routed_experts=True)


# ---- engine (bf16, its own process) -> samples -> trainer forward (fp32) ----------------------

@pytest.fixture(scope="module")
def bf16_batch(moe_dir, tmp_path_factory):
    return bf16_routed_batch(moe_dir, tmp_path_factory.mktemp("moe_engine"))


def _trainer_forward(moe_dir, mb, replay: bool):
    """The trainer's float32 forward of the batch; (stats, per-token |trainer - rollout|
    log-prob gap over response tokens, the expert ids each experts block was given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    stats, given = RoutingStats(), {}
    handles = [model.get_submodule(f"model.layers.{i}.mlp.experts").register_forward_pre_hook(
        lambda m, args, i=i: given.__setitem__(i, args[1].clone())) for i, _ in moe_routers(model)]
    with torch.no_grad(), routing_replay(model, mb.routed, mb.routed_valid(), replay=replay,
                                         stats=stats):
        logp = gather_logprobs(scaled_logits(model, mb, 1.0), mb.targets)
    for h in handles:
        h.remove()
    gap = (logp - mb.rollout_logp).abs().masked_fill(mb.weights == 0, 0.0)  # response tokens
    return stats, gap, given


def test_replay_routes_as_the_rollout_did_and_shrinks_the_logprob_gap(moe_dir, bf16_batch):
    mb = bf16_batch
    assert mb.routed is not None and mb.routed.shape[2] == LAYERS * TOPK  # per token
    own, gap_own, _ = _trainer_forward(moe_dir, mb, replay=False)
    replayed, gap_replayed, given = _trainer_forward(moe_dir, mb, replay=True)
    # the comparison covers every token but each row's last, in both MoE layers
    tokens = sum(n - 1 for n in mb.seq_lens)
    assert own.pairs == replayed.pairs == LAYERS * tokens
    assert own.mismatched > 0, "bf16 engine and fp32 trainer agreed everywhere: no test"
    assert replayed.mismatched == own.mismatched  # measured against the trainer's own router
    # with replay, the experts ran on exactly the rollout's ids at every covered position
    valid = mb.routed_valid().reshape(-1)
    want = mb.routed.reshape(*mb.routed.shape[:2], LAYERS, TOPK)
    for layer, ids in given.items():
        assert torch.equal(ids[valid].long(), want[:, :, layer].reshape(-1, TOPK)[valid].long())
    # the log-prob gap: the tokens downstream of a disagreement (in their row, through
    # attention) are the ones replay changes; there it removes the disagreement's share, which
    # dwarfs bf16 rounding (elsewhere both forwards are the same computation)
    changed = (gap_own - gap_replayed).abs() > 1e-4
    assert changed.any()
    # (measured: 12 of 1916 token x layer pairs disagree, 21 response tokens change, their mean
    # gap halves: 1.2e-3 -> 0.6e-3)
    assert gap_replayed[changed].mean() < gap_own[changed].mean()
    assert gap_replayed.sum() < gap_own.sum()
