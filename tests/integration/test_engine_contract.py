"""The engine contract, on the real SGLang (on CPU, the venv of relax-sglang-cpu) and on our hf
engine alike (issue #33): what the trainer and the launcher rely on while engines are paused.

- A paused engine is alive and not ready: GET /server_info answers (SGLang's scheduler answers
  it paused or not) and GET /ready says 503, so the launcher's hang watch does not name a paused
  engine however long the pause. SGLang's /health, which the watch used to probe, generates a
  token: it waits for un-pause and answers 503 after 20 s.
- A sync that fails midway leaves the engines paused until the resend; the cohort's wait
  accepts paused engines; the resend continues them at the new version.
- The API key guards every route but the probes (/health*, /ready*, /metrics*): a 401 without
  it or with a wrong one, and a refused call changes nothing.
- The weight version label set by /update_weight_version is what /model_info and every
  /generate answer report.
- Weights by reference (/update_weights_from_tensor, weight_sync.transport=tensor: shared
  memory on CPU, CUDA IPC on GPUs) load exactly as the same weights broadcast over the group
  do, one tensor per pickle and as flattened buckets, and never move the sender's tensors
  into shared memory.
- /abort_request with abort_all ends a running batch with finish_reason abort (HTTP 200, the
  tokens so far with their log-probs), and the engine serves the next request whole.
- LoRA adapters (started with --enable-lora): each version's adapter loads under its own name
  beside the one before, the version that left the window is unloaded, a resend of a loaded
  version is accepted, and a client told of a version the engine does not hold names the
  engine's own label; the answer has that version's adapter's log-probs, stamped with it
  (engines/served_adapter.py, WeightSender.send_adapter).
- An update naming a tensor the model lacks: SGLang answers success and skips it, the hf
  engine refuses it (the trainer checks its names first: weightsync/names.py).
- A sync the engine never receives (the engine frozen, its scheduler with it) fails within
  weight_sync.timeout_s naming it, and once let go the engine takes the re-formed cohort's
  resend.
- An engine whose port is taken exits as soon as its bind fails.
- SGLang on CPU forks its scheduler and detokenizer (the CPU venv's shim), so they do not
  import everything again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import (check_frozen_sync, free_port, make_tiny_model,  # noqa: E402
                          process_cpu_s, run_script, start_engine, start_sglang_engine,
                          stop_process, wait_healthy)

from relax_slurm.engines.async_client import AsyncEngineClient  # noqa: E402
from relax_slurm.engines.client import EngineClient  # noqa: E402
from relax_slurm.engines.sglang_api import API_KEY_ENV, lora_flags  # noqa: E402
from relax_slurm.launch.health import HangWatch  # noqa: E402

KEY = "contract-key"
# the adapter versions of test_adapter_versions_...: every B of one nonzero adapter times these
SCALE = {100: 1.0, 101: 1.25, 102: 1.5, 103: 1.75}
LP_TOL = 2e-5  # their log-probs against PEFT's (see the test)
LORA_RANK, LORA_TARGETS = 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("contract") / "model")


@pytest.fixture(scope="module",
                params=[pytest.param("sglang", marks=pytest.mark.sglang_cpu), "hf"])
def engine(request, model_dir, tmp_path_factory):
    """(kind, URL, process, log) of one engine serving the tiny model with an API key."""
    kind, port = request.param, free_port()
    log = tmp_path_factory.mktemp(kind) / "engine.log"
    if kind == "sglang":
        python = request.getfixturevalue("sglang_cpu_python")
        proc = start_sglang_engine(python, model_dir, port, log, api_key=KEY,
                                   extra_args=lora_flags(LORA_RANK, LORA_TARGETS, "cpu"))
    else:
        proc = start_engine(model_dir, port, log, ["--enable-lora"], api_key=KEY)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300, log)
        yield kind, url, proc, log
    finally:
        stop_process(proc)


@pytest.fixture
def client(engine, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    with EngineClient(engine[1], 30.0) as c:
        yield c


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def test_sglang_on_cpu_forks_its_scheduler_and_detokenizer(engine):
    """SGLang spawns its scheduler and detokenizer (CUDA needs it), and each spawned child
    imported SGLang, transformers and torch again: ~20 of a tiny CPU server's ~30 CPU-s of
    start, paid by every SGLang engine of the suite. Without CUDA the CPU venv's shim forks
    them, and the children inherit the server's imports. The first test of the module: the
    detokenizer has detokenized nothing yet, so its CPU time is what its start cost (~0.2 s
    forked, ~9 s spawned, against the server's own ~8 s)."""
    kind, _, proc, log = engine
    if kind != "sglang":
        pytest.skip("SGLang's own processes; the hf engine is one process")
    titles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
              for pid in _children(proc.pid)}  # SGLang titles its processes (setproctitle)
    [detokenizer_pid] = [pid for pid, t in titles.items() if "detokenizer" in t] or [None]
    assert detokenizer_pid, (titles, Path(log).read_text()[-3000:])
    server, detokenizer = process_cpu_s(proc.pid), process_cpu_s(detokenizer_pid)
    # spawned it costs about the server's own start (1.0x); forked, a few percent of it
    assert detokenizer < 0.25 * server, (detokenizer, server)


def test_a_paused_engine_is_alive_and_not_ready_and_never_named_hung(engine, client):
    kind, url, proc, _ = engine
    assert client.ready() is True and client.alive() is True
    now = [0.0]  # a fake clock, moved 20 s before each check: two missed probes in a row
    # pass the 30 s timeout, one alone does not (as on a real clock, where one probe slowed past
    # its wait on a loaded machine names no engine). Interval 10 s: its probe waits
    # min(5 s, interval) for an answer; 1 s was short for a paused SGLang on a loaded machine
    watch = HangWatch(None, "unused", {"engine0": url}, interval_s=10.0, timeout_s=30.0,
                      clock=lambda: now[0], engine_key=KEY)

    def check():
        now[0] += 20.0
        return watch.check()

    client.pause_generation("retract")
    try:
        assert client.ready() is False  # paused: takes no new requests
        assert client.alive() is True
        for _ in range(6):  # two minutes of pause, as the watch counts
            assert check() is None
    finally:
        client.continue_generation()
    assert client.ready() is True
    # a frozen engine is still named: the probe answers nothing at all
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        hung = None
        for _ in range(3):
            hung = hung or check()
        assert hung is not None and hung[0] == "engine0", hung
        assert "/server_info" in hung[1]
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        watch.close()
    assert client.alive() is True


def test_a_sync_failed_midway_leaves_the_engines_paused_until_the_resend(engine, client,
                                                                         model_dir, tmp_path):
    kind, url, _, _ = engine
    r = run_script("paused_after_failed_sync.py", tmp_path, "--url", url, model_dir=model_dir,
                   env={API_KEY_ENV: KEY})
    assert r["ready_before"] is True, r
    assert r["error"] is not None and "weight_sync.timeout_s" in r["error"], r
    assert r["buckets_begun"] >= 2, r  # failed midway: a bucket went through before
    # paused, under the old label: nothing is served with half of the new weights
    assert r["ready_after_failure"] is False, r
    assert r["version_after_failure"] == "0", r
    assert r["ready_after_resend"] is True and r["version_after_resend"] == "2", r
    assert client.ready() is True


def test_weights_by_reference_load_exactly_as_broadcast_ones(engine, client, model_dir,
                                                             tmp_path):
    kind, url, _, _ = engine
    r = run_script("weights_by_reference.py", tmp_path, "--url", url, model_dir=model_dir,
                   env={API_KEY_ENV: KEY})
    assert r["versions"] == ["4", "5", "6", "7"], r
    # other weights: other log-probs (1.03 apart at most on both engines)
    assert max(abs(a - b) for a, b in zip(r["tensor1"], r["broadcast0"])) > 0.1, r
    # the same engine, the same weights, the same request: the same floats, whichever way
    # the weights came (nothing to round: both copy the sender's float32 bytes)
    assert r["tensor1"] == r["broadcast1"], r
    assert r["tensor0"] == r["broadcast0"], r
    assert r["tensor_stats"]["broadcasts"] == 0 and r["tensor_stats"]["num_buckets"] > 1, r
    assert r["shared"] is False, r  # the sender's tensors stay where they were
    # the engine serves model_dir's weights again (tensor0): the later tests see them


def lora_policy(model_dir: Path):
    """The tiny model under PEFT with a nonzero adapter (B random), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax_slurm.config.model import LoraConfig, ModelConfig
    from relax_slurm.trainer.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       ModelConfig(path=str(model_dir), lora=LoraConfig(
                           rank=LORA_RANK, target_modules=LORA_TARGETS)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def teacher_forced(model, prompt: list[int], out_ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]


def test_adapter_versions_load_beside_each_other_within_the_window(engine, client, model_dir):
    """What an async adapter sync relies on: requests keep generating on their version's
    adapter while the next one loads, and one that names a version the engine does not hold
    (restarted, or fallen out of the window) is sent again under the engine's own."""
    import dataclasses

    from relax_slurm.engines.served_adapter import ServedAdapter, adapter_name
    from relax_slurm.errors import EngineError
    from relax_slurm.trainer.lora import adapter_of
    from relax_slurm.weightsync.sender import WeightSender

    kind, url, _, _ = engine
    before = client.weight_version()
    policy = lora_policy(model_dir)
    adapter = adapter_of(policy)
    versions = range(100, 104)  # each its own policy: every B x SCALE[v]
    sent = {v: dataclasses.replace(adapter, tensors={
        n: t * SCALE[v] if "lora_B" in n else t for n, t in adapter.tensors.items()})
        for v in versions}
    sender = WeightSender([url], "127.0.0.1", 1, timeout_s=60, adapter_window=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    try:
        for v in versions:
            assert sender.send_adapter(sent[v], v)["bytes"] == adapter.nbytes
        sender.send_adapter(sent[103], 103)  # a resend after a failed sync: held already
        sender._finish_unloads()
        assert client.weight_version() == "103"
        for v in versions:  # 100 and 101 left the window
            with EngineClient(url, 30.0, lora_path=adapter_name(v)) as named:
                if v >= 102:
                    assert named.generate(prompts, params)[0].weight_version == "103"
                else:
                    with pytest.raises(EngineError, match="not loaded|implicitly load"):
                        named.generate(prompts, params)

        async def told_of(announced: int):
            served = ServedAdapter(lambda: announced)
            async with AsyncEngineClient(url, 30.0, adapter=served) as c:
                return await c.generate(prompts, params), served.seen
        # the broker announced a version this engine never held
        results, seen = asyncio.run(told_of(109))
        assert seen == 103 and {r.weight_version for r in results} == {"103"}, kind
        import torch

        def scaled_b(factor: float) -> None:
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.mul_(factor)
        scaled_b(SCALE[102])
        before = [teacher_forced(policy, p, r.output_ids) for p, r in zip(prompts, results)]
        scaled_b(SCALE[103] / SCALE[102])  # version 103's policy
        for prompt, res, v102 in zip(prompts, results, before):
            # SGLang's torch_native LoRA (fused q/k/v, gate/up) and the hf engine's PEFT
            # layers against PEFT's, float32: rounding only, which grows with the adapter
            # (measured on SGLang at B x 1.75: <= 4.3e-6 over 16 requests; at B x 4 up to
            # 1.0e-5); version 102's adapter is 0.9-2.0 away (measured)
            want = teacher_forced(policy, prompt, res.output_ids)
            assert max(abs(a - b) for a, b in zip(res.logprobs, want)) < LP_TOL, kind
            apart = max(abs(a - b) for a, b in zip(res.logprobs, v102))
            assert apart > 100 * LP_TOL, kind
        # the evaluator's client names the engine's own label
        with EngineClient(url, 30.0, adapter=ServedAdapter()) as evaluator:
            assert {r.weight_version for r in evaluator.generate(prompts, params)} == {"103"}
    finally:
        sender.close()
        for v in versions:  # the engine as the other tests found it
            client.unload_lora_adapter(adapter_name(v))
        client.update_weight_version(before)


def test_token_ids_logprob_scores_those_ids_at_every_input_position(engine, client):
    """SGLang's token_ids_logprob, which a teacher's prefill asks for the student's media pads
    (renormalized without them, rollout/services.py): None at the first position, then
    [logprob, id, text] per asked id; an asked id that is the next input token has that
    token's own input log-prob."""
    ids, watch = [5, 6, 7, 8, 9], [3, 7]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "token_ids_logprob": watch}
    meta = client._json("/generate", client._call("POST", "/generate", body))["meta_info"]
    per = meta["input_token_ids_logprobs"]
    assert len(per) == len(ids) and per[0] is None, per
    for position in per[1:]:
        assert [e[1] for e in position] == watch and all(e[0] <= 0.0 for e in position)
    # ids[2] is 7: its log-prob at position 2, either way (float32: the same op on one row)
    assert abs(per[2][1][0] - meta["input_token_logprobs"][2][0]) < 1e-5, (per, meta)


GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def test_the_api_key_guards_every_route_but_the_probes(engine, client):
    kind, url, _, _ = engine
    refused = [("GET", "/model_info", None), ("GET", "/server_info", None),
               ("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY}),
               ("POST", "/update_weight_version", {"new_version": "9"}),
               ("POST", "/pause_generation", {"mode": "retract"})]
    version = client.weight_version()
    with httpx.Client(base_url=url, timeout=60.0) as http:
        for route in ("/health", "/ready"):  # a cluster's probes carry no secret
            assert http.get(route).status_code == 200, (kind, route)
        for method, route, body in refused:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = http.request(method, route, json=body, headers=headers)
                assert r.status_code == 401, (kind, route, headers, r.status_code, r.text)
    # nothing a refused call asked for happened: not paused, not relabelled
    assert client.ready() is True and client.weight_version() == version


async def async_weight_version(url: str) -> str | None:
    async with AsyncEngineClient(url, 30.0) as client:
        return await client.weight_version()


def test_the_version_label_is_what_model_info_and_generate_report(engine, client):
    kind, before = engine[0], client.weight_version()
    try:
        client.update_weight_version("7")
        assert client.weight_version() == "7"
        # the rollout worker's async client reads it the same way (rollout/version_gate.py)
        assert asyncio.run(async_weight_version(engine[1])) == "7"
        results = client.generate([[5, 6, 7], [8, 9]], GREEDY)
        for r in results:
            assert (r.finish_reason, len(r.output_ids), len(r.logprobs)) == ("length", 4, 4), kind
            assert r.weight_version == "7" and r.versions() == [7], (kind, r.meta_info)
    finally:
        client.update_weight_version(before)
    assert client.weight_version() == before


def test_abort_all_ends_a_running_batch_with_finish_reason_abort(engine, client):
    """The abort is sent every 20 ms until the request returns, so it lands whatever the
    machine's load; a request that ran to its end before any abort reached it (possible
    only if the whole generation fit between two) is tried again."""
    kind, limit = engine[0], 400  # the tiny model's 512 positions, minus the prompt
    params = {"max_new_tokens": limit, "temperature": 1.0, "ignore_eos": True}
    for _ in range(5):
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, [[5, 6, 7], [8, 9, 10]], params)
            while not pending.done():
                client.abort_request(abort_all=True)
                time.sleep(0.02)
            results = pending.result()
        if any(r.finish_reason == "abort" for r in results):
            break
    assert {r.finish_reason for r in results} == {"abort"}, (kind, [r.meta_info for r in results])
    for r in results:  # the tokens so far, each with its log-prob, never a full-length answer
        assert len(r.output_ids) < limit and len(r.logprobs) == len(r.output_ids), kind
    [after] = client.generate([[5, 6, 7]], {**GREEDY, "max_new_tokens": 8})
    assert (after.finish_reason, len(after.output_ids)) == ("length", 8), kind


def flush_when_idle(client: EngineClient, timeout_s: float = 60.0) -> None:
    """/flush_cache once the engine takes it: SGLang refuses it (HTTP 400) while a request is
    in its batch, and the last one's answer can reach the client an iteration of the
    scheduler's loop before the request leaves the batch."""
    from relax_slurm.errors import EngineError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.flush_cache()
        except EngineError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_an_update_naming_a_tensor_the_model_lacks(engine, client, model_dir):
    """SGLang answers success and keeps its old tensors (one line in its log), which is why the
    trainer checks every name against the checkpoint before it sends (weightsync/names.py); the
    hf engine refuses, naming it. A resend of the model's own weights serves on."""
    from safetensors.torch import load_file

    from relax_slurm.errors import WeightSyncError
    from relax_slurm.weightsync.sender import WeightSender

    kind, url, _, log = engine
    named = list(load_file(str(model_dir / "model.safetensors")).items())
    probe = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    # an earlier test left this prompt in SGLang's prefix cache, and the update below flushes
    # it: served from the cache, the prompt's KV came from another kernel path (decode, not
    # prefill), 1.7e-6 off in CI. Both answers from an empty cache take the same path.
    flush_when_idle(client)
    [before] = client.generate([[5, 6, 7]], probe, return_logprob=True)
    sender = WeightSender([url], "127.0.0.1", free_port(), f"relax_test_unknown_{kind}", "gloo",
                          60.0, 512)
    sender.connect()
    try:
        unknown = [("model.layers.0.mlp.nonexistent.weight", named[0][1] + 1.0)]
        if kind == "sglang":
            sender.send(unknown, version="x1")
            assert "model.layers.0.mlp.nonexistent.weight not found" in Path(log).read_text()
            # the same weights, request and kernels: the same answer up to float32 rounding;
            # 1e-5 is this file's bound for SGLang's float32 log-probs by two code paths (the
            # token-ids test), and a tensor that had landed (the model's first plus 1.0)
            # moves them by orders of magnitude more
            [after] = client.generate([[5, 6, 7]], probe, return_logprob=True)
            assert after.output_ids == before.output_ids
            assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-5
        else:
            with pytest.raises(WeightSyncError, match="unknown parameter 'model.layers.0.mlp."
                                                      "nonexistent.weight'"):
                sender.send(unknown, version="x1")
    finally:
        sender.close()
    resend = WeightSender([url], "127.0.0.1", free_port(), f"relax_test_unknown_{kind}_c1",
                          "gloo", 60.0, 512)
    resend.connect()
    try:
        resend.send(named, version="x2")
    finally:
        resend.destroy_on_engines()
        resend.close()
    assert client.ready() is True and client.weight_version() == "x2"


def test_sglang_on_cpu_freezes_its_start_up_heap_once_it_listens(engine):
    """SGLang freezes its start-up objects out of the garbage collector after its warm-up, by
    a POST /freeze_gc to itself; with --skip-server-warmup (the CPU engine's flags) that POST
    went out before the port listened and was refused, so every /release_memory_occupation
    and every weight update's cache flush ran a full gc.collect() over the scheduler's heap
    (SGLang's CPU `empty_cache`, ~0.5 s each on the tiny model). The CPU venv's shim makes the
    freeze wait for the port (relax_sglang_cpu_shim.py)."""
    kind, _, proc, log = engine
    if kind != "sglang":
        pytest.skip("SGLang's own start-up step; the hf engine has no /freeze_gc")
    deadline = time.monotonic() + 60  # the freeze follows the first answer of the port
    while 'POST /freeze_gc HTTP/1.1" 200' not in Path(log).read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, Path(log).read_text()[-3000:]
        time.sleep(0.2)
    assert "post-warmup freeze_gc failed" not in Path(log).read_text(errors="replace")


@pytest.mark.parametrize("kind", [pytest.param("sglang", marks=pytest.mark.sglang_cpu), "hf"])
def test_an_engine_whose_port_is_taken_exits_at_once(kind, model_dir, tmp_path, request):
    """Two engines given one port (a stale engine of a restarted role, another user's server
    on a shared node): the second fails to bind and must exit then, so the launcher reports
    its death instead of waiting out the start-up timeout. SGLang binds only after loading
    the model, and its app's shutdown joins the warm-up thread; the CPU shim's GC-freeze
    wait ran inside that thread and held the exit for its whole 120 s bound."""
    import socket

    port, log = free_port(), tmp_path / "engine.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()  # never accepts: a probe of this port gets no answer
        if kind == "sglang":
            proc = start_sglang_engine(request.getfixturevalue("sglang_cpu_python"), model_dir,
                                       port, log, api_key=KEY)
        else:
            proc = start_engine(model_dir, port, log, api_key=KEY)
        try:
            deadline = time.monotonic() + 300  # the model loads before the bind
            while "address already in use" not in log.read_text(errors="replace").lower():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            # what is left after the refused bind is the process's own shutdown (SGLang: its
            # scheduler and detokenizer); 60 s is far above it and half the old wait
            proc.wait(timeout=60)
            assert proc.returncode != 0
        finally:
            stop_process(proc)


def test_a_sync_this_engine_never_receives_fails_naming_it_and_the_cohort_recovers(
        engine, client, model_dir, tmp_path):
    """The engine frozen (its whole process group: SGLang's scheduler receives) just before a
    bucket's broadcast, beside an hf engine that receives. Gloo's collective timeout ends the
    wait first, the clock that once left the error naming no engine (test_cohort.py runs the
    other two on hf engines). Let go, the engine takes the re-formed cohort's resend of the
    model's own weights, so the tests after this one see them."""
    kind, url, proc, _ = engine
    r = run_script("frozen_engine_sync.py", tmp_path, "--url", url, "--pid", str(proc.pid),
                   model_dir=model_dir, env={API_KEY_ENV: KEY, "FIRST": "group"})
    check_frozen_sync(r)
    assert client.ready() is True
