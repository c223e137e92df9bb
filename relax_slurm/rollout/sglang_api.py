"""SGLang's side of the engine protocol, in one place: request bodies and the server command line.

SGLang does not install on CPU machines (it pins a CUDA torch), so its request schemas are
recorded here from SGLang 0.5.x (python/sglang/srt/managers/io_struct.py) and
tests/unit/rollout/test_sglang_contract.py checks every body the client sends against them; the
hf engine parses the same bodies, so the whole client path runs in CI. When `import sglang`
works the contract test also compares these records with the installed dataclasses.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Optional

API_KEY_ENV = "RELAX_ENGINE_API_KEY"
"""Environment variable with the engines' API key: servers read it at start (--api-key) and
clients send it as `Authorization: Bearer KEY`; it never lands in a config or a log."""


def api_key() -> str | None:
    """The engines' API key from the environment (relax-train sets it to the run's secret
    unless the user set one), or None."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


OPEN_ROUTES = ("/health", "/metrics")
"""Routes SGLang serves without the API key (liveness probes); the hf engine does the same."""

# Fields of SGLang 0.5.x request dataclasses: {class: (required, optional)}. `rid` and
# `http_worker_ipc` come from BaseReq and are never sent by us.
SGLANG_REQUESTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "InitWeightsUpdateGroupReqInput": (
        frozenset({"master_address", "master_port", "rank_offset", "world_size"}),
        frozenset({"group_name", "backend"})),
    "DestroyWeightsUpdateGroupReqInput": (frozenset(), frozenset({"group_name"})),
    "UpdateWeightsFromDistributedReqInput": (
        frozenset({"names", "dtypes", "shapes"}),
        frozenset({"group_name", "flush_cache", "abort_all_requests", "weight_version",
                   "load_format", "torch_empty_cache"})),
    "PauseGenerationReqInput": (frozenset(), frozenset({"mode"})),
    "AbortReq": (frozenset(), frozenset({"rid", "abort_all", "finished_reason",
                                         "abort_message"})),
    "ReleaseMemoryOccupationReqInput": (frozenset(), frozenset({"tags"})),
    "ResumeMemoryOccupationReqInput": (frozenset(), frozenset({"tags"})),
    # the fields of /generate we send: media as one list of items (file name, URL, base64) per
    # input of a batch (SGLang's MultimodalDataInputFormat)
    "GenerateReqInput": (frozenset(), frozenset({
        "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
        "image_data", "video_data", "audio_data"})),
}

# route -> request class (routes without a body: /health, /health_generate, /flush_cache,
# /continue_generation, /get_model_info, /get_weight_version)
ROUTE_REQUEST = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/generate": "GenerateReqInput",
}

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
"""Regions /release_memory_occupation accepts (SGLang 0.5.x); None means all of them."""


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int,
                    group_name: str, backend: str) -> dict[str, Any]:
    """The engine joins as ranks rank_offset + tp_rank (trainer rank 0 is rank 0)."""
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}


def update_weights_body(names: list[str], dtypes: list[str], shapes: list[list[int]],
                        group_name: str, weight_version: Optional[str],
                        flush_cache: bool, load_format: Optional[str] = None) -> dict[str, Any]:
    body = {"names": list(names), "dtypes": list(dtypes),
            "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": weight_version}
    if load_format is not None:  # older servers may not know the field
        body["load_format"] = load_format
    return body


def pause_body(mode: str) -> dict[str, Any]:
    return {"mode": mode}


def abort_body(rid: str = "", abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid, "abort_all": abort_all}


def memory_body(tags: Optional[list[str]]) -> dict[str, Any]:
    return {"tags": None if tags is None else list(tags)}


def check_body(route: str, body: dict[str, Any]) -> None:
    """ValueError naming the route and key when `body` would not build SGLang's request."""
    required, optional = SGLANG_REQUESTS[ROUTE_REQUEST[route]]
    unknown = set(body) - required - optional
    missing = required - set(body)
    if unknown or missing:
        raise ValueError(f"{route}: body keys {sorted(body)} do not match SGLang's "
                         f"{ROUTE_REQUEST[route]} (unknown {sorted(unknown)}, missing "
                         f"{sorted(missing)})")


def server_argv(python: str, *, model_path: str, host: str, port: int, base_gpu_id: int,
                tp_size: int,
                ep_size: int, mem_fraction_static: float, dtype: str, seed: int,
                trust_remote_code: bool, api_key: bool, enable_memory_saver: bool,
                extra_args: list[str]) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine (flags of SGLang 0.5.x server_args).

    --base-gpu-id places engines that share a node (with each other or the trainer) on
    disjoint GPUs. --enable-memory-saver is what makes /release_memory_occupation free GPU memory (colocated
    placement); --weight-version starts the version at 0 like the hf engine."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--base-gpu-id", str(base_gpu_id),
            "--tp-size", str(tp_size),
            "--mem-fraction-static", str(mem_fraction_static), "--dtype", dtype,
            "--random-seed", str(seed), "--weight-version", "0"]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if ep_size > 1:
        argv += ["--ep-size", str(ep_size)]
    if enable_memory_saver:
        argv.append("--enable-memory-saver")
    argv += list(extra_args)
    if api_key:
        # the shell expands the key at start: it is in no file and no printed command line
        return ["bash", "-c", f'exec {shlex.join(argv)} --api-key "${API_KEY_ENV}"']
    return argv
