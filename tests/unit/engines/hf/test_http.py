"""The hf engine as a real process: every route's JSON shape, batching, pause, errors, clients."""

import asyncio
import math
import threading
import time

import httpx
import pytest

from helpers_tiny import free_port, running_engine
from relax_slurm.errors import EngineError
from relax_slurm.engines import sglang_api
from relax_slurm.engines.async_client import AsyncEngineClient
from relax_slurm.engines.client import EngineClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EOS = 1
PROMPTS = [[4, 5, 13, 6, 14], [9, 10], [3, 3, 3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    with running_engine(tiny_model_dir, tmp_path_factory.mktemp("engine_log"),
                        ["--max-batch-size", "64", "--batch-wait-ms", "50"]) as url:
        yield url


def post(url, route, body, timeout=60):
    return httpx.post(url + route, json=body, timeout=timeout)


def status(url):
    return httpx.get(url + "/server_info", timeout=10).json()


def wait_for(condition, what, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def check_item(item, max_new, want_logprobs=True):
    assert set(item) >= {"text", "output_ids", "meta_info"}
    meta = item["meta_info"]
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "weight_version"}
    ids = item["output_ids"]
    assert 1 <= len(ids) <= max_new and meta["completion_tokens"] == len(ids)
    assert all(isinstance(t, int) and 0 <= t < 16 for t in ids)
    finish = meta["finish_reason"]
    if finish["type"] == "length":
        assert finish == {"type": "length", "length": max_new} and len(ids) == max_new
    else:
        assert finish == {"type": "stop", "matched": EOS} and ids[-1] == EOS
        assert EOS not in ids[:-1]
    if want_logprobs:
        lps = meta["output_token_logprobs"]
        assert len(lps) == len(ids)
        for (lp, tok, text), out_tok in zip(lps, ids):
            assert tok == out_tok and text is None and math.isfinite(lp) and lp <= 0.0
    else:
        assert "output_token_logprobs" not in meta


def test_info_routes(engine_url, tiny_model_dir):
    assert httpx.get(engine_url + "/health").status_code == 200
    info = httpx.get(engine_url + "/model_info").json()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert httpx.get(engine_url + "/get_model_info").json() == info  # SGLang's older name
    # as in SGLang 0.5.21+: the version is read from /model_info only
    assert httpx.get(engine_url + "/get_weight_version").status_code == 404
    server = httpx.get(engine_url + "/server_info").json()
    assert server["engine"] == "hf" and server["version"] == sglang_api.HF_PROTOCOL
    assert httpx.get(engine_url + "/get_server_info").json()["version"] == server["version"]
    assert httpx.post(engine_url + "/flush_cache").status_code == 200
    sums = httpx.get(engine_url + "/weights_checksum").json()["checksums"]
    # tied embeddings: both names present, same tensor
    assert sums["lm_head.weight"] == sums["model.embed_tokens.weight"]
    assert all(len(h) == 64 for h in sums.values())


def test_generate_single_and_batch(engine_url):
    sp = {"max_new_tokens": 6, "temperature": 1.0}
    single = post(engine_url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp,
                                            "return_logprob": True}).json()
    assert isinstance(single, dict)
    check_item(single, 6)
    batch = post(engine_url, "/generate", {"input_ids": PROMPTS, "sampling_params": sp,
                                           "return_logprob": True}).json()
    assert isinstance(batch, list) and len(batch) == 3
    for item in batch:
        check_item(item, 6)
        assert item["meta_info"]["weight_version"] == "0"
    one = post(engine_url, "/generate", {"input_ids": [PROMPTS[1]], "sampling_params": sp}).json()
    assert isinstance(one, list) and len(one) == 1
    check_item(one[0], 6, want_logprobs=False)
    text = post(engine_url, "/generate", {"text": ["1+2=", "33"], "sampling_params": sp}).json()
    assert [t["meta_info"]["prompt_tokens"] for t in text] == [4, 2]


def test_finish_reasons_eos_length_and_stop_tokens(engine_url):
    greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    out = post(engine_url, "/generate", {"input_ids": PROMPTS, "sampling_params": greedy}).json()
    for item in out:
        assert len(item["output_ids"]) == 5
        assert item["meta_info"]["finish_reason"]["type"] == "length"
    # greedy is deterministic, alone or batched with left padding
    again = post(engine_url, "/generate",
                 {"input_ids": PROMPTS[2], "sampling_params": greedy}).json()
    assert again["output_ids"] == out[2]["output_ids"]
    # a stop token ends the sequence with finish_reason stop, the token included
    first = out[0]["output_ids"][0]
    stopped = post(engine_url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0, "stop_token_ids": [first]}}).json()
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    # a stop string ends it too; text is cut before the string
    text = out[1]["text"]
    assert text, "greedy output decodes to nothing"
    stop_str = text[-1]
    cut = post(engine_url, "/generate", {"input_ids": PROMPTS[1], "sampling_params": {
        **greedy, "stop": [stop_str]}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert cut["text"] == text[:text.find(stop_str)]
    assert cut["output_ids"] == out[1]["output_ids"][:len(cut["output_ids"])]
    # sampling at temperature 1 over 16 tokens: EOS ends some sequences, length others
    many = post(engine_url, "/generate", {"input_ids": [PROMPTS[0]] * 24, "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0}, "return_logprob": True}).json()
    for item in many:
        check_item(item, 12)
    assert any(i["meta_info"]["finish_reason"]["type"] == "stop" for i in many)


def test_concurrent_requests_are_batched(engine_url):
    before = httpx.get(engine_url + "/get_server_info").json()["internal_states"][0]
    results, errors = [None] * 8, []

    def one(i):
        try:
            sp = {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 8}
            results[i] = post(engine_url, "/generate", {
                "input_ids": PROMPTS[i % 3], "sampling_params": sp, "return_logprob": True}).json()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    for r in results:
        check_item(r, 4)
    # every response its own id, shaped as SGLang's (32 hex digits), batched or not
    ids = [r["meta_info"]["id"] for r in results]
    assert len(set(ids)) == 8 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    after = httpx.get(engine_url + "/get_server_info").json()["internal_states"][0]
    assert after["num_sequences"] - before["num_sequences"] == 8
    assert after["num_batches"] - before["num_batches"] < 8  # some requests shared a batch


def test_pause_and_continue(engine_url):
    assert post(engine_url, "/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    done = threading.Event()
    result = {}

    def gen():
        result["r"] = post(engine_url, "/generate", {"input_ids": PROMPTS[0],
                                                     "sampling_params": {"max_new_tokens": 2}})
        done.set()

    t = threading.Thread(target=gen)
    t.start()
    try:
        assert not done.wait(1.0), "generation ran while paused"
    finally:
        assert post(engine_url, "/continue_generation", {}).status_code == 200
    assert done.wait(30)
    t.join()
    assert result["r"].status_code == 200


def test_errors_are_json(engine_url):
    cases = [
        {"sampling_params": {"max_new_tokens": 2}},                      # no input
        {"input_ids": [1, 99]},                                          # outside vocab
        {"input_ids": []},                                               # empty
        {"input_ids": [1, 2], "sampling_params": {"bogus": 1}},          # unknown param
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": [1, 2], "stream": True},
    ]
    for body in cases:
        r = post(engine_url, "/generate", body)
        assert r.status_code == 400, body
        assert r.json()["success"] is False and r.json()["message"]
    r = httpx.post(engine_url + "/generate", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["success"] is False
    update = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}
    r = post(engine_url, "/update_weights_from_distributed", update)  # outside a session
    assert r.status_code == 400 and r.json()["message"] == sglang_api.OUT_OF_SESSION
    assert post(engine_url, "/end_weight_update", {}).status_code == 400  # none open
    assert post(engine_url, "/begin_weight_update", {}).json()["success"] is True
    try:
        again = post(engine_url, "/begin_weight_update", {})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        r = post(engine_url, "/update_weights_from_distributed", update)
        assert r.status_code == 400 and "nope" in r.json()["message"]
    finally:
        assert post(engine_url, "/end_weight_update", {}).json()["success"] is True
    r = post(engine_url, "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert r.status_code == 400 and r.json()["success"] is False


def test_sync_client(engine_url, tiny_model_dir):
    with EngineClient(engine_url, timeout_s=60) as client:
        assert client.health()
        assert client.model_info()["model_path"] == str(tiny_model_dir)
        assert client.weight_version() == "0"
        assert client.protocol() == sglang_api.ServerProtocol("hf", sglang_api.HF_PROTOCOL)
        results = client.generate(PROMPTS, {"max_new_tokens": 5, "temperature": 1.0})
        assert len(results) == 3
        for r in results:
            assert len(r.output_ids) == len(r.logprobs) >= 1
            assert r.finish_reason in ("stop", "length") and r.weight_version == "0"
            assert r.weight_versions == [("0", 0, len(r.output_ids))] and r.versions() == [0]
        client.flush_cache()
        client.pause_generation("in_place")
        client.continue_generation()
        assert "lm_head.weight" in client.weights_checksum()
        with pytest.raises(EngineError) as err:
            client.generate([[1, 99]], {"max_new_tokens": 2})
        assert engine_url in str(err.value) and "/generate" in str(err.value)
        assert "vocabulary" in str(err.value)
    with EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=2) as dead:
        with pytest.raises(EngineError, match="/health"):
            dead.health()
        with pytest.raises(EngineError, match="/model_info"):
            dead.model_info()


def test_async_client(engine_url):
    async def run():
        async with AsyncEngineClient(engine_url, timeout_s=60) as client:
            assert await client.health()
            outs = await asyncio.gather(*[
                client.generate([p], {"max_new_tokens": 3, "temperature": 1.0}) for p in PROMPTS])
            return outs

    outs = asyncio.run(run())
    assert [len(o) for o in outs] == [1, 1, 1]
    assert all(len(o[0].output_ids) == len(o[0].logprobs) for o in outs)


def test_logprobs_match_teacher_forcing(engine_url, tiny_model_dir):
    """Engine log-probs equal log_softmax(logits / T) of a plain forward pass (what the trainer
    recomputes), for each sequence of a left-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    temperature = 0.8
    out = post(engine_url, "/generate", {"input_ids": PROMPTS, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 6,
                                                             "temperature": temperature}}).json()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, item in zip(PROMPTS, out):
        response = item["output_ids"]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature  # [T, V]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])
        got = torch.tensor([lp for lp, _, _ in item["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected.squeeze(1), atol=1e-4), (got, expected)


def test_prefill_logprobs_of_the_input(engine_url):
    """max_new_tokens=0 with logprob_start_len (how a teacher scores a response): SGLang's
    meta_info.input_token_logprobs, equal to the log-probs the tokens got when sampled at
    temperature 1, and at temperature 1 whatever the request says (SGLang's prefill reads no
    sampling params)."""
    temperature = 1.0
    sp = {"max_new_tokens": 5, "temperature": temperature}
    gen = post(engine_url, "/generate", {"input_ids": PROMPTS, "sampling_params": sp,
                                         "return_logprob": True}).json()
    seqs = [p + g["output_ids"] for p, g in zip(PROMPTS, gen)]
    score = {"input_ids": seqs, "return_logprob": True, "logprob_start_len": 0,
             "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}
    out = post(engine_url, "/generate", score).json()
    for prompt, seq, g, item in zip(PROMPTS, seqs, gen, out):
        assert item["output_ids"] == [] and item["meta_info"]["output_token_logprobs"] == []
        assert item["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        entries = item["meta_info"]["input_token_logprobs"]
        assert [tok for _, tok, _ in entries] == seq and entries[0][0] is None
        assert all(text is None for _, _, text in entries)
        scored = [lp for lp, _, _ in entries[len(prompt):]]
        sampled = [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]]
        assert scored == pytest.approx(sampled, abs=1e-4)

    # a later start slices the same values; the default (-1) returns none
    one = post(engine_url, "/generate", {**score, "input_ids": seqs[0],
                                         "logprob_start_len": 2}).json()
    tail = one["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in tail] == seqs[0][2:]
    assert [e[0] for e in tail] == pytest.approx([e[0] for e in out[0]["meta_info"]
                                                  ["input_token_logprobs"][2:]], abs=1e-5)
    cooler = post(engine_url, "/generate", {**score, "sampling_params": {
        "max_new_tokens": 0, "temperature": 0.5}}).json()
    assert [i["meta_info"]["input_token_logprobs"] for i in cooler] == \
        [i["meta_info"]["input_token_logprobs"] for i in out]
    plain = post(engine_url, "/generate", {**score, "logprob_start_len": None}).json()
    assert all("input_token_logprobs" not in item["meta_info"] for item in plain)
    bad = post(engine_url, "/generate", {**score, "logprob_start_len": len(seqs[0]) + 5})
    assert bad.status_code == 400 and "logprob_start_len" in bad.json()["message"]

    async def score_async():
        async with AsyncEngineClient(engine_url, timeout_s=60) as client:
            return await client.prefill_logprobs(seqs)

    lps = asyncio.run(score_async())
    for seq, item, row in zip(seqs, out, lps):
        assert len(row) == len(seq) - 1
        assert row == pytest.approx([e[0] for e in item["meta_info"]["input_token_logprobs"][1:]],
                                    abs=1e-6)


def test_coalesced_calls_share_one_request_and_keep_their_seeded_responses(engine_url):
    """Groups started in the same loop turn go out as one /generate; each caller gets its own
    slice back, the same tokens its seeds draw when it is sent alone."""
    from relax_slurm.rollout.coalesce import CoalescingEngine

    def params(g):
        return [{"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 100 * g + i}
                for i in range(3)]

    async def run(max_groups):
        async with AsyncEngineClient(engine_url, timeout_s=60) as client:
            engine = CoalescingEngine(client, max_groups)
            return await asyncio.gather(*[engine.generate([PROMPTS[g % 3]] * 3, params(g))
                                          for g in range(5)])

    info = lambda: httpx.get(engine_url + "/get_server_info").json()["internal_states"][0]  # noqa: E731
    before = info()
    together = asyncio.run(run(max_groups=8))
    after = info()
    assert after["num_batches"] - before["num_batches"] == 1  # one request, one generate call
    assert after["max_batch_seen"] >= 15
    alone = asyncio.run(run(max_groups=1))
    assert [[r.output_ids for r in g] for g in together] == \
        [[r.output_ids for r in g] for g in alone]
    assert all(len(g) == 3 for g in together)


def test_colocated_memory_routes_abort_and_health_generate(engine_url):
    """The routes of colocated mode through the client: released memory refuses /generate
    until resumed; an abort_all drops queued requests with finish_reason abort."""
    with EngineClient(engine_url, timeout_s=60) as c:
        assert c.health_generate()
        c.pause_generation("retract")  # as the trainer does: SGLang asserts an idle engine
        c.release_memory_occupation()
        info = httpx.get(engine_url + "/server_info", timeout=10).json()
        assert info["memory_released"] == ["kv_cache", "weights"] and info["paused"]
        with pytest.raises(EngineError, match="resume_memory_occupation"):
            c.generate([PROMPTS[0]], {"max_new_tokens": 2})
        c.resume_memory_occupation(["kv_cache"])  # weights still released
        with pytest.raises(EngineError, match="weights"):
            c.generate([PROMPTS[0]], {"max_new_tokens": 2})
        c.resume_memory_occupation(["weights"])
        c.continue_generation()  # resuming memory does not continue generation (SGLang)
        assert len(c.generate([PROMPTS[0]], {"max_new_tokens": 2})[0].output_ids) >= 1
        with pytest.raises(EngineError, match="unknown tags"):
            c.release_memory_occupation(["cuda_graph_x"])

        # queue a request behind a pause, abort everything, then continue
        c.pause_generation("in_place")
        result = {}
        t = threading.Thread(target=lambda: result.setdefault(
            "r", c.generate([PROMPTS[0]], {"max_new_tokens": 2})))
        t.start()
        wait_for(lambda: status(engine_url)["queued_sequences"] == 1, "the request to queue")
        c.abort_request(abort_all=True)
        t.join(30)
        c.continue_generation()
        assert result["r"][0].finish_reason == "abort"
        assert result["r"][0].meta_info["finish_reason"]["message"] == "Abort in waiting queue"
        c.abort_request(rid="no-such-request")  # unknown rid: a no-op, as in SGLang
        assert c.generate([PROMPTS[0]], {"max_new_tokens": 2})[0].finish_reason in ("stop", "length")
    bad = post(engine_url, "/update_weights_from_distributed",
               {"names": [], "dtypes": [], "shapes": [], "bogus": 1})
    assert bad.status_code == 400 and "bogus" in bad.json()["message"]
