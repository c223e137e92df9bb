"""SGLang's side of the engine protocol, in one place: the versions spoken, request bodies and
the server command line.

The protocol is that of SGLang 0.5.21 .. 0.5.23 (SUPPORTED_SGLANG, the `gpu` extra's pin): a
weight update runs inside a session (/begin_weight_update .. /end_weight_update), the served
version is read from /model_info, and a finished /generate result carries the version spans of
its tokens (`meta_info.weight_versions`). A client learns a server's version from /server_info
at connect time and refuses one outside the range. SGLang does not install on CPU machines (it
pins a CUDA torch), so the request schemas are recorded here from its io_struct.py;
tests/unit/engines/test_sglang_contract.py checks every body the client sends against this
record and tests/unit/engines/test_sglang_source.py checks the record, the routes and the launch
line against the released wheels of every supported version. The hf engine serves the same
protocol (it reports HF_PROTOCOL as its version), so the whole client path runs in CI.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from relax_slurm.engines.sglang_cpu import CPU_FLAGS, SERVER_ENV
from relax_slurm.errors import EngineError

SUPPORTED_SGLANG = ">=0.5.21,<0.5.24"
"""SGLang releases whose protocol this client speaks (setup.cfg's `gpu` extra pins the same)."""
TESTED_SGLANG = ("0.5.21", "0.5.22", "0.5.23")
"""Every release in the range, each checked against its own source by the contract tests."""
HF_PROTOCOL = TESTED_SGLANG[-1]
"""The SGLang release whose protocol the hf engine mirrors (its /server_info `version`)."""

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


OPEN_ROUTES = ("/health", "/ready", "/metrics")
"""Routes SGLang serves without the API key (liveness and readiness probes, by prefix:
`sglang.srt.utils.auth.decide_request_auth`); the hf engine does the same."""

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
                   "load_format", "torch_empty_cache", "selector"})),
    # the tensors by reference (CUDA IPC / shared memory), one payload per TP rank
    # (weight_sync.transport=tensor, weightsync/ipc.py)
    "UpdateWeightsFromTensorReqInput": (
        frozenset({"serialized_named_tensors"}),
        frozenset({"load_format", "flush_cache", "abort_all_requests", "weight_version",
                   "selector", "torch_empty_cache"})),
    # a weight-update session: updates are refused outside one (0.5.21+)
    "BeginWeightUpdateReqInput": (frozenset(), frozenset({"selector"})),
    "EndWeightUpdateReqInput": (frozenset(), frozenset()),
    "PauseGenerationReqInput": (frozenset(), frozenset({"mode"})),
    "ContinueGenerationReqInput": (frozenset(), frozenset({"torch_empty_cache"})),
    "AbortReq": (frozenset(), frozenset({"rid", "abort_all", "finished_reason",
                                         "abort_message"})),
    "ReleaseMemoryOccupationReqInput": (frozenset(), frozenset({"tags"})),
    "ResumeMemoryOccupationReqInput": (frozenset(), frozenset({"tags"})),
    # the fields of /generate we send: media as one list of items (file name, URL, base64) per
    # input of a batch (SGLang's MultimodalDataInputFormat)
    "GenerateReqInput": (frozenset(), frozenset({
        "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
        "image_data", "video_data", "audio_data", "return_routed_experts",
        "routed_experts_start_len", "lora_path", "token_ids_logprob"})),
    # LoRA adapters (an engine started with --enable-lora): loaded from tensors in the body,
    # unloaded by name, named by /generate's lora_path
    "LoadLoRAAdapterFromTensorsReqInput": (
        frozenset({"lora_name", "config_dict", "serialized_named_tensors"}),
        frozenset({"pinned", "added_tokens_config", "lora_id", "load_format",
                   "expected_checksums"})),
    "UnloadLoRAAdapterReqInput": (frozenset({"lora_name"}), frozenset({"lora_id"})),
    "UpdateWeightVersionReqInput": (frozenset({"new_version"}),
                                    frozenset({"abort_all_requests"})),
}

# route -> request class (routes without a body: /health, /health_generate, /flush_cache,
# /model_info, /server_info)
ROUTE_REQUEST = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/generate": "GenerateReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}

GET_ROUTES = ("/health", "/health_generate", "/ready", "/model_info", "/server_info")
"""Routes the client reads with GET."""
POST_ROUTES = (*ROUTE_REQUEST, "/flush_cache")
"""Routes the client posts to."""
DEPRECATED_ROUTE = {"/model_info": "/get_model_info", "/server_info": "/get_server_info"}
"""Older names of the two info routes; a client falls back to them on a 404."""

ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""The server flag without which /generate ignores return_routed_experts (0.5.21+)."""
ROUTED_EXPERTS_REQUEST = ("return_routed_experts", "routed_experts_start_len")
"""GenerateReqInput's fields: the flag, and the first position returned (0: the whole
sequence); the answer is meta_info.routed_experts (relax_slurm.routing.shape)."""

HEAD_NEVER_TIED = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
"""Architectures whose SGLang model (0.5.2x models/qwen3_moe.py, qwen2_moe.py) builds its own
output head whatever config.json's tie_word_embeddings says: a tied checkpoint has no
lm_head.weight, so the head keeps uninitialised memory and every answer is garbage
(docs/engines.md#sglang-on-cpu; on GPUs too). Qwen's own MoE checkpoints are untied."""


QWEN3_VL_MOE_DEEPSTACK = 3
"""DeepStack layers SGLang 0.5.2x's Qwen3-VL-MoE language model (the Qwen3-Omni thinker's
too) adds vision features to, whatever the model's vision_config.deepstack_visual_indexes
says (models/qwen3_vl_moe.py: range(3), Qwen's released checkpoints' count): fewer fail its
forward at the first image, more are ignored."""
_DEEPSTACK_3 = ("Qwen3VLMoeForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration")
_INTERLEAVED_MROPE = ("Qwen3VLForConditionalGeneration", *_DEEPSTACK_3)
"""transformers always interleaves these models' M-RoPE sections; SGLang does only when the
text config's rope dict says mrope_interleaved (layers/rotary_embedding/factory.py)."""


def _thinker(config: dict) -> dict:
    """The part of a config.json that holds text_config / vision_config (Qwen3-Omni nests them
    under thinker_config)."""
    return config.get("thinker_config") or config


def deepstack_unlike_sglangs(config: dict) -> int | None:
    """A Qwen3-VL-MoE's or Qwen3-Omni's DeepStack layer count when SGLang would not serve it as
    transformers computes it, else None."""
    if not any(a in _DEEPSTACK_3 for a in config.get("architectures") or []):
        return None
    vision = _thinker(config).get("vision_config") or {}
    n = len(vision.get("deepstack_visual_indexes") or [])
    return None if n == QWEN3_VL_MOE_DEEPSTACK else n


def mrope_sectioned_on_sglang(config: dict) -> bool:
    """Whether SGLang would compute this Qwen3-VL / Qwen3-Omni's M-RoPE in sections where
    transformers interleaves them (no mrope_interleaved in its text rope settings): media
    prompts' log-probs then differ (3e-4 to 5e-4 on the tiny Qwen3-Omni's images)."""
    if not any(a in _INTERLEAVED_MROPE for a in config.get("architectures") or []):
        return False
    text = _thinker(config).get("text_config") or {}
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    return "mrope_section" in rope and not rope.get("mrope_interleaved")


def head_left_empty(config: dict) -> bool:
    """Whether SGLang would serve this config.json's model with an empty output head."""
    return bool(config.get("tie_word_embeddings")) and any(
        a in HEAD_NEVER_TIED for a in config.get("architectures") or [])


NO_SGLANG_MODEL = ("Qwen2_5OmniForConditionalGeneration",)
"""Architectures the project trains that SGLang 0.5.21-0.5.23 has no model class for (no
`EntryClass` in sglang/srt/models names them: tests/unit/engines/test_sglang_source.py reads
every tested release)."""


def _no_model(config: dict, model_dir: Path) -> str | None:
    arch = next((a for a in config.get("architectures") or [] if a in NO_SGLANG_MODEL), None)
    return arch and (
        f"a {arch}, which SGLang {', '.join(TESTED_SGLANG)} has no model for (none of "
        "sglang/srt/models names it). Use rollout.engine=hf for this model (its thinker "
        "generates there)")


def _experts_transposed(config: dict, model_dir: Path) -> str | None:
    from relax_slurm.modeling import experts_in_transformers_layout

    name = experts_in_transformers_layout(model_dir, config)
    return name and (
        f"{name} is in transformers 5's layout of a Qwen3-VL-MoE's fused experts (what its "
        "save_pretrained writes for a model it built), which SGLang cannot load (it reads "
        "Qwen's released layout: gate_up_proj [experts, hidden, 2 x moe_intermediate], "
        "down_proj [experts, moe_intermediate, hidden]). Fix: save the two fused tensors of "
        "every layer transposed in their last two dimensions (transformers reads either "
        "layout), or use rollout.engine=hf")


def _deepstack(config: dict, model_dir: Path) -> str | None:
    layers = deepstack_unlike_sglangs(config)
    return None if layers is None else (
        f"a {config['architectures'][0]} with {layers} DeepStack layers "
        "(vision_config.deepstack_visual_indexes); SGLang's Qwen3-VL-MoE language model adds "
        f"vision features to exactly {QWEN3_VL_MOE_DEEPSTACK} decoder layers, as Qwen's "
        "checkpoints have (fewer fail at the first image, more are ignored). Use "
        "rollout.engine=hf for this model")


def _mrope_sections(config: dict, model_dir: Path) -> str | None:
    return None if not mrope_sectioned_on_sglang(config) else (
        "its text_config's rope settings (rope_scaling / rope_parameters) have mrope_section "
        "but no \"mrope_interleaved\": true; transformers interleaves this model's M-RoPE "
        "sections always, SGLang only with that key, so its log-probs of image and video "
        "prompts would differ from the trainer's. Fix: add \"mrope_interleaved\": true there "
        "in config.json (Qwen's released configs have it)")


def _untied_head(config: dict, model_dir: Path) -> str | None:
    return None if not head_left_empty(config) else (
        f"a {config['architectures'][0]} with tie_word_embeddings=true, whose output head "
        "SGLang never ties (it would serve a head the checkpoint does not hold: uninitialised "
        "memory, garbage log-probs). Save the model untied: load it with transformers, set "
        "model.config.tie_word_embeddings=False and model.lm_head.weight = a copy of the input "
        "embedding, then save_pretrained; or use rollout.engine=hf")


UNSERVABLE = (_no_model, _experts_transposed, _deepstack, _mrope_sections, _untied_head)
"""What SGLang 0.5.2x assumes of a checkpoint that transformers does not: each rule reads
config.json (and the weights' headers) and says why and the fix, or None."""


def why_unservable(model_dir: Path) -> str | None:
    """Why SGLang would not serve model_dir as the trainer computes it (the first UNSERVABLE
    rule that applies), or None. relax-train checks every model rollout=sglang serves."""
    config = json.loads((model_dir / "config.json").read_text())
    for rule in UNSERVABLE:
        why = rule(config, model_dir)
        if why:
            return why
    return None


ADAPTER_NAME = "policy"
"""The stem of the names the trained LoRA adapter is served under (/generate's lora_path): one
name per version, `policy-v<version>` (engines/served_adapter.py)."""
LORA_FLAGS = ("--enable-lora",)
"""What an engine that serves the adapter is started with (SGLang also needs the rank and
target modules: `lora_flags`)."""

PAUSE_MODES = ("abort", "retract", "in_place")
FLUSHABLE_PAUSE_MODES = ("abort", "retract")
"""Pause modes under which a weight update may flush the cache. in_place keeps the running
requests (and their KV) in the batch, and the update's flush then finds them: SGLang 0.5.21
asserts and its scheduler dies, 0.5.22+ answer HTTP 400 after loading the weights. Every sync
flushes (a prefix cache computed by the old weights must not serve the new ones)."""
OUT_OF_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                  "end_weight_update()")
"""SGLang's answer to an update outside a session (the hf engine answers the same)."""
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")
"""SGLang 0.5.22+'s answer to a flushing update while requests are paused in place."""


@dataclass(frozen=True)
class ServerProtocol:
    """What a server speaks, from its /server_info: SGLang's release, or the hf engine's
    HF_PROTOCOL."""

    engine: str
    """sglang or hf"""
    version: str

    def __str__(self) -> str:
        if self.engine == "hf":
            return f"the hf engine (SGLang {self.version}'s protocol)"
        return f"SGLang {self.version}"

    def check_pause_mode(self, mode: str) -> None:
        """EngineError naming weight_sync.pause_mode when this server cannot flush after a
        pause in `mode` (see FLUSHABLE_PAUSE_MODES)."""
        if mode not in FLUSHABLE_PAUSE_MODES:
            raise EngineError(
                f"weight_sync.pause_mode={mode}: {self} cannot flush its "
                "cache after a weight update while requests are paused in place (SGLang 0.5.21 "
                "kills its scheduler, 0.5.22+ answer HTTP 400), and every sync flushes; use "
                "retract (running requests go back to the queue and continue on the new "
                "weights) or abort (they end with finish_reason abort and are generated again)")


def server_protocol(info: dict[str, Any], url: str) -> ServerProtocol:
    """/server_info's body -> ServerProtocol; EngineError naming the supported range when the
    server runs an SGLang outside it."""
    if info.get("engine") == "hf":
        return ServerProtocol("hf", str(info.get("version", HF_PROTOCOL)))
    raw = str(info.get("version", ""))
    try:
        supported = Version(raw) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        supported = False
    if not supported:
        raise EngineError(
            f"engine {url} runs SGLang {raw or '(no version in /server_info)'}; relax-slurm "
            f"speaks SGLang {SUPPORTED_SGLANG} (tested: {', '.join(TESTED_SGLANG)}): install "
            f"one with pip install 'sglang{SUPPORTED_SGLANG}' (see docs/engines.md#versions)")
    return ServerProtocol("sglang", raw)
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


def tensor_update_body(payloads: list[str], weight_version: Optional[str], flush_cache: bool,
                       load_format: Optional[str] = None) -> dict[str, Any]:
    """/update_weights_from_tensor: `payloads`, one per TP rank (weightsync/ipc.py)."""
    body = {"serialized_named_tensors": list(payloads), "flush_cache": flush_cache,
            "weight_version": weight_version}
    if load_format is not None:
        body["load_format"] = load_format
    return body


def load_adapter_body(name: str, config: dict[str, Any], payload: str, tp_size: int
                      ) -> dict[str, Any]:
    """/load_lora_adapter_from_tensors: `payload` is the adapter's tensors serialized once
    (weightsync/adapter.py), one copy per TP rank as SGLang's tp workers each read theirs."""
    return {"lora_name": name, "config_dict": dict(config),
            "serialized_named_tensors": [payload] * int(tp_size)}


def version_body(version: str) -> dict[str, Any]:
    """/update_weight_version without aborting: the sync paused what had to be paused."""
    return {"new_version": str(version), "abort_all_requests": False}


def lora_flags(rank: int, target_modules: list[str], device: str) -> list[str]:
    """SGLang's launch flags to serve adapters up to `rank` on `target_modules` loaded later
    from tensors; on CPU its torch_native LoRA backend (the default, csgmv, is a GPU kernel)."""
    flags = [*LORA_FLAGS, "--max-lora-rank", str(int(rank)),
             "--lora-target-modules", *target_modules]
    if device == "cpu":
        flags += ["--lora-backend", "torch_native"]
    return flags


def pause_body(mode: str) -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r}: use one of {', '.join(PAUSE_MODES)}")
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


RL_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
"""Environment of every SGLang engine a run starts. SGLang keeps the vision / audio tower's
output per image (video, audio) in a cache keyed by the item's content (100 MB by default) and
no weight update or /flush_cache clears it (0.5.23: `mm_schedule.embedding_cache`): after a
sync, an image seen before is served with the features of the weights it was first seen under,
so the tower's training never reaches the rollouts and their log-probs drift from the
trainer's (issue #33: the tiny VL task's 20 images, all seen at step 0). Size 0 caches nothing
across batches: each prefill batch encodes its distinct items once (a group's n samples,
batched together, share one encoding)."""


MM_PROCESS_FLAG = "--mm-process-config"


def mm_process_args(model_path: str, image_min_pixels: Optional[int],
                    image_max_pixels: Optional[int], extra_args: list[str] = ()) -> list[str]:
    """`--mm-process-config {"image": {"size": ...}}` so that SGLang's image processor resizes
    as the rollout worker's does (data.image_min_pixels / image_max_pixels); [] when neither is
    set, or when `extra_args` (rollout.engine_extra_args) already has the flag (the user's
    own wins). SGLang passes the "image" keys to the processor's call; the Qwen-VL processors
    take the limits as `size` {shortest_edge, longest_edge}, pixel counts, and refuse a size
    without both: the model's other one is kept (its preprocessor_config.json, in the model
    directory or the local Hugging Face cache), as the worker does (data/processor.py
    `_size_kwargs`). With one limit and no readable model config, no flag: SGLang then keeps the
    model's limits, and the worker's token-count check names the mismatch at the first prompt."""
    if image_min_pixels is None and image_max_pixels is None:
        return []
    if any(a == MM_PROCESS_FLAG or a.startswith(MM_PROCESS_FLAG + "=") for a in extra_args):
        return []
    size = _processor_size(model_path)
    if image_min_pixels is not None:
        size["shortest_edge"] = int(image_min_pixels)
    if image_max_pixels is not None:
        size["longest_edge"] = int(image_max_pixels)
    if set(size) != {"shortest_edge", "longest_edge"}:
        return []
    return [MM_PROCESS_FLAG, json.dumps({"image": {"size": size}}, sort_keys=True)]


def _processor_size(model_path: str) -> dict[str, int]:
    """The image processor's {shortest_edge, longest_edge} from the model's
    preprocessor_config.json where the launcher can read it ({} otherwise); offline."""
    from transformers.utils import cached_file

    try:
        path = cached_file(model_path, "preprocessor_config.json", local_files_only=True,
                           _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
        pre = json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):  # not a model directory nor a hub id
        return {}
    size = {k: int(v) for k, v in (pre.get("size") or {}).items()
            if k in ("shortest_edge", "longest_edge")}
    for key, old in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if key not in size and pre.get(old) is not None:  # older processors' spelling
            size[key] = int(pre[old])
    return size


def server_argv(python: str, *, model_path: str, host: str, port: int, base_gpu_id: int,
                tp_size: int,
                ep_size: int, mem_fraction_static: float, dtype: str, seed: int,
                trust_remote_code: bool, api_key: bool, enable_memory_saver: bool,
                extra_args: list[str], deterministic: bool = False,
                routed_experts: bool = False, device: str = "cuda",
                lora: Optional[tuple[int, list[str]]] = None,
                nccl_port: Optional[int] = None) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine (flags of SGLang 0.5.x server_args).

    --base-gpu-id places engines that share a node (with each other or the trainer) on
    disjoint GPUs. --enable-memory-saver is what makes /release_memory_occupation free GPU
    memory (colocated placement; GPUs only); --weight-version starts the version at 0 like the hf engine.
    --enable-deterministic-inference (rollout.deterministic): without it SGLang ignores
    `sampling_params.sampling_seed`, so a resumed run would not draw the same tokens.
    --enable-return-routed-experts (MoE models, rollout.return_routed_experts): without it a
    request's return_routed_experts is silently ignored (no meta_info.routed_experts).
    device="cpu": SGLang's CPU engine (sglang_cpu.SERVER_ENV, set with `env`, and CPU_FLAGS
    instead of --base-gpu-id; docs/engines.md#sglang-on-cpu). Every engine gets RL_ENV.
    `lora`: (rank, target modules) of the adapter each sync loads (`lora_flags`,
    docs/lora.md).
    `nccl_port`: --nccl-port, the port of the scheduler's own torch.distributed store (bound
    by SGLang's scheduler a few seconds into its start). Without it SGLang draws one itself
    (0.5.22+: 22000-29999; earlier: its HTTP port + 100..1000, inside our own range) where
    no other process of the run or of the host can see it; the launcher hands out one it
    reserved (runtime/ports.py), so every port on the host is drawn in one place."""
    env = RL_ENV | (SERVER_ENV if device == "cpu" else {})
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())]
    placement = list(CPU_FLAGS) if device == "cpu" else ["--base-gpu-id", str(base_gpu_id)]
    argv = [*prefix, python, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), *placement,
            "--tp-size", str(tp_size),
            "--mem-fraction-static", str(mem_fraction_static), "--dtype", dtype,
            "--random-seed", str(seed), "--weight-version", "0"]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if ep_size > 1:
        argv += ["--ep-size", str(ep_size)]
    if enable_memory_saver and device != "cpu":
        # torch_memory_saver is CUDA-only (the CPU venv leaves it out: the server would die
        # importing it); without it SGLang's release/resume answer 200 and free nothing, which
        # on CPU is all there is to free
        argv.append("--enable-memory-saver")
    if deterministic:
        argv.append("--enable-deterministic-inference")
    if routed_experts:
        argv.append(ROUTED_EXPERTS_FLAG)
    if lora is not None:
        argv += lora_flags(lora[0], lora[1], device)
    argv += list(extra_args)
    if api_key:
        # the shell expands the key at start: it is in no file and no printed command line
        return ["bash", "-c", f'exec {shlex.join(argv)} --api-key "${API_KEY_ENV}"']
    return argv
