"""The hf engine's HTTP server: SGLang's routes over an `HFEngine` (see core.py); the
command line that serves them is __main__.py (`python -m relax_slurm.engines.hf`).

  POST /generate                      text | input_ids (one or a batch), sampling_params,
                                      return_logprob, logprob_start_len, image_data,
                                      video_data, audio_data
                                      -> {text, output_ids, meta_info} or a list
  GET  /health, /health_generate      200 when the generation thread is alive, else 503
  GET  /model_info, /server_info      (and their older names /get_model_info, /get_server_info)
  POST /init_weights_update_group     join the trainer's weight-sync group (blocks until formed)
  POST /destroy_weights_update_group  leave it
  POST /begin_weight_update, /end_weight_update   the session updates must run in
  POST /update_weights_from_distributed  receive one broadcast per name from rank 0, in order
  POST /update_weights_from_tensor    tensors shared by reference from the same host (ipc.py)
                                      (load_format=flattened_bucket: one of them all)
  POST /pause_generation, /continue_generation   modes abort, retract, in_place (SGLang's)
  POST /flush_cache                   no prefix cache here: a no-op answering 200
  GET  /weights_checksum              hf extension: sha256 of every parameter's raw bytes
  POST /load_lora_adapter_from_tensors, /unload_lora_adapter   LoRA adapters by name (started
                                      with --enable-lora; /generate's lora_path names one)
  POST /update_weight_version         label the weights served from now on
"""

from __future__ import annotations

import asyncio
import functools
import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse as _StdJSONResponse
from fastapi.responses import Response

from relax_slurm.auth import bearer_matches
from relax_slurm.config.weight_sync import FLATTENED_BUCKET
from relax_slurm.errors import WeightSyncError
from relax_slurm.engines import sglang_api
from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.parsing import (BadRequest, NotServing, parse_generate_request,
                                             parse_lora_path, parse_media, parse_routing_request,
                                             parse_token_ids_logprob, process_media)
from relax_slurm.weightsync import ipc
from relax_slurm.weightsync.adapter import read_tensors

log = logging.getLogger("relax_slurm.hf_engine")


class JSONResponse(_StdJSONResponse):
    """Starlette's JSONResponse rendered by orjson, as SGLang's server answers: the answer to a
    step's /generate of 512 sequences (ids and log-probs) took ~10 ms in json.dumps, after
    generation and before the worker sees anything."""

    def render(self, content: object) -> bytes:
        # non-str keys become strings, as json.dumps writes them
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def _error(status: int, message: str) -> JSONResponse:
    # {success, message} as SGLang's weight routes; {error: {message}} as its /generate errors
    return JSONResponse({"success": False, "message": message, "error": {"message": message}},
                        status_code=status)


def _json_errors(fn):
    """Every failure becomes JSON {success: false, message} with a 4xx/5xx code."""
    @functools.wraps(fn)
    async def wrapper(request: Request):
        try:
            return await fn(request)
        except (BadRequest, WeightSyncError, ValueError, KeyError, TypeError) as e:
            return _error(400, f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e))
        except NotServing as e:
            return _error(503, str(e))
        except (asyncio.TimeoutError, TimeoutError) as e:
            return _error(504, f"timed out: {e}")
        except Exception as e:
            log.exception("%s failed", request.url.path)
            return _error(500, f"{type(e).__name__}: {e}")
    return wrapper


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _memory_tags(body: dict, route: str) -> list[str]:
    sglang_api.check_body(route, body)
    tags = body.get("tags")
    if tags is None:
        return list(sglang_api.MEMORY_TAGS)
    bad = [t for t in tags if t not in sglang_api.MEMORY_TAGS]
    if bad:
        raise BadRequest(f"{route}: unknown tags {bad}; use {list(sglang_api.MEMORY_TAGS)}")
    return list(tags)


def build_app(engine: HFEngine, request_timeout_s: float, api_key: str | None = None
              ) -> FastAPI:
    """The SGLang routes; with `api_key`, every route but the probes (/health*, /ready*,
    /metrics*) wants `Authorization: Bearer KEY` (401 otherwise), as SGLang's --api-key."""
    app = FastAPI(title="relax-slurm hf engine")

    if api_key:
        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if (not request.url.path.startswith(sglang_api.OPEN_ROUTES)
                    and not bearer_matches(api_key, request.headers.get("authorization"))):
                return JSONResponse({"error": "missing or wrong API key (Authorization: Bearer "
                                              f"${sglang_api.API_KEY_ENV})"}, status_code=401)
            return await call_next(request)

    _generation_routes(app, engine, request_timeout_s)
    _info_routes(app, engine)
    _weight_routes(app, engine)
    _memory_routes(app, engine)
    _adapter_routes(app, engine)
    return app


def _generation_routes(app: FastAPI, engine: HFEngine, request_timeout_s: float) -> None:
    """/generate, pause and continue, abort."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    @_json_errors
    async def generate(request: Request):
        body = await _body(request)
        engine.check_serving()
        prompts, specs, flags, starts, is_batch = parse_generate_request(
            body, engine.tokenizer, engine.vocab_size)
        media = parse_media(body, len(prompts), is_batch)
        routed_start = parse_routing_request(body, prompts)
        lora_path = parse_lora_path(body)
        token_ids = parse_token_ids_logprob(body, len(prompts), engine.vocab_size)
        prompts, mm = await asyncio.to_thread(process_media, engine.media, engine.model_path,
                                              prompts, media)
        future = engine.submit(prompts, specs, flags, starts, mm, routed_start, lora_path,
                               token_ids)
        items = await asyncio.wait_for(asyncio.wrap_future(future), timeout=request_timeout_s)
        return JSONResponse(items if is_batch else items[0])

    @app.post("/pause_generation")
    @_json_errors
    async def pause_generation(request: Request):
        mode = (await _body(request)).get("mode", "abort")
        if mode not in sglang_api.PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of abort, retract, in_place")
        await asyncio.to_thread(engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    @_json_errors
    async def continue_generation(request: Request) -> JSONResponse:
        sglang_api.check_body("/continue_generation", await _body(request))
        engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    @_json_errors
    async def abort_request(request: Request):
        b = await _body(request)
        sglang_api.check_body("/abort_request", b)
        # no request ids here: a single rid matches nothing, as an unknown rid in SGLang
        if b.get("abort_all"):
            engine.abort_all()
        return Response(status_code=200)


def _info_routes(app: FastAPI, engine: HFEngine) -> None:
    """Health, model and server info (the engine's `status()`), checksums."""

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive() else 503)

    @app.get("/ready")
    async def ready() -> Response:
        # SGLang's: takes new requests now (up and not paused)
        return Response(status_code=200 if engine.alive() and not engine.status()["paused"]
                        else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")  # its older name, still served by SGLang
    async def model_info() -> dict:
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        if not engine.alive():  # SGLang's answer needs its scheduler's (EngineClient.alive)
            return JSONResponse({"error": "the generation thread has stopped"}, status_code=503)
        # `version`: the SGLang release whose protocol this server speaks
        return JSONResponse({"engine": "hf", "version": sglang_api.HF_PROTOCOL,
                "model_path": engine.model_path, "max_batch_size": engine.max_batch_size,
                "batch_wait_ms": engine.batch_wait_s * 1000.0,
                "weight_version": engine.weight_version, **engine.status(),
                "internal_states": [dict(engine.stats)]})

    @app.get("/weights_checksum")
    async def weights_checksum() -> dict:
        checksums = await asyncio.to_thread(engine.checksums)
        return {"success": True, "weight_version": engine.weight_version, "checksums": checksums}


def _weight_routes(app: FastAPI, engine: HFEngine) -> None:
    """The weight-sync group, the update session and the updates."""

    @app.post("/init_weights_update_group")
    @_json_errors
    async def init_weights_update_group(request: Request):
        b = await _body(request)
        sglang_api.check_body("/init_weights_update_group", b)
        await asyncio.to_thread(engine.init_group, str(b["master_address"]),
                                int(b["master_port"]), int(b["rank_offset"]),
                                int(b["world_size"]), b.get("group_name", "weight_update_group"),
                                b.get("backend", "nccl"))
        return JSONResponse({"success": True,
                             "message": "Succeeded to initialize custom process group."})

    @app.post("/destroy_weights_update_group")
    @_json_errors
    async def destroy_weights_update_group(request: Request):
        name = (await _body(request)).get("group_name", "weight_update_group")
        if not await asyncio.to_thread(engine.destroy_group, name):
            raise BadRequest("The group to be destroyed does not exist.")
        return JSONResponse({"success": True,
                             "message": "Succeeded to destroy custom process group."})

    @app.post("/begin_weight_update")
    @_json_errors
    async def begin_weight_update(request: Request):
        sglang_api.check_body("/begin_weight_update", await _body(request))
        engine.begin_session()
        return JSONResponse({"success": True, "message": "Success"})

    @app.post("/end_weight_update")
    @_json_errors
    async def end_weight_update(request: Request):
        await _body(request)  # SGLang ignores what it does not know
        engine.end_session()
        return JSONResponse({"success": True, "message": "Success"})

    @app.post("/update_weights_from_distributed")
    @_json_errors
    async def update_weights_from_distributed(request: Request):
        b = await _body(request)
        sglang_api.check_body("/update_weights_from_distributed", b)
        names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), list(b["shapes"])
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes differ in length: {len(names)}, "
                             f"{len(dtypes)}, {len(shapes)}")
        load_format = b.get("load_format")
        if load_format not in (None, FLATTENED_BUCKET):
            raise BadRequest(f"load_format={load_format!r} is not supported by the hf engine: "
                             f"use null (one broadcast per tensor) or {FLATTENED_BUCKET}")
        group = b.get("group_name", "weight_update_group")
        version = b.get("weight_version")
        await asyncio.to_thread(engine.update_weights, names, dtypes, shapes, group, version,
                                bool(b.get("flush_cache", True)), load_format == FLATTENED_BUCKET)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message})

    @app.post("/update_weights_from_tensor")
    @_json_errors
    async def update_weights_from_tensor(request: Request):
        b = await _body(request)
        sglang_api.check_body("/update_weights_from_tensor", b)
        load_format = b.get("load_format")
        if load_format not in (None, FLATTENED_BUCKET):
            raise BadRequest(f"load_format={load_format!r} is not supported by the hf engine: "
                             f"use null (a list of named tensors) or {FLATTENED_BUCKET}")
        payloads = b["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors: one payload per TP rank (the hf engine "
                             "is one rank)")
        # opened outside the model lock: generation goes on meanwhile
        named = await asyncio.to_thread(
            lambda: [(n, t.to(engine.device)) for n, t in
                     ipc.named_tensors(ipc.read_payload(payloads[0]), load_format)])
        await asyncio.to_thread(engine.update_weights_from_tensor, named,
                                b.get("weight_version"), bool(b.get("flush_cache", True)))
        return JSONResponse({"success": True, "message": "Success"})


def _memory_routes(app: FastAPI, engine: HFEngine) -> None:
    """Colocated placement's memory release and resume, and the (no-op) cache flush."""

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(content="Cache flushed.\n", status_code=200)  # no prefix cache to drop

    @app.post("/release_memory_occupation")
    @_json_errors
    async def release_memory_occupation(request: Request):
        tags = _memory_tags(await _body(request), "/release_memory_occupation")
        engine.release_memory(tags)
        return JSONResponse({"success": True, "message": f"released {sorted(tags)}"})

    @app.post("/resume_memory_occupation")
    @_json_errors
    async def resume_memory_occupation(request: Request):
        tags = _memory_tags(await _body(request), "/resume_memory_occupation")
        engine.resume_memory(tags)
        return JSONResponse({"success": True, "message": f"resumed {sorted(tags)}"})


def _adapter_routes(app: FastAPI, engine: HFEngine) -> None:
    """LoRA adapters (adapters.py) and the served version's label, SGLang's answers."""

    def loaded() -> dict:
        return {name: name for name in sorted(engine.adapters.loaded)}

    @app.post("/load_lora_adapter_from_tensors")
    @_json_errors
    async def load_lora_adapter_from_tensors(request: Request):
        b = await _body(request)
        sglang_api.check_body("/load_lora_adapter_from_tensors", b)
        if b.get("load_format") is not None:
            raise BadRequest(f"load_format={b['load_format']!r} is not supported by the hf "
                             "engine's adapters: send null")
        payloads = b["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors: one payload per TP rank (the hf engine "
                             "is one rank)")
        tensors = await asyncio.to_thread(read_tensors, payloads[0])
        await asyncio.to_thread(engine.load_adapter, str(b["lora_name"]),
                                dict(b["config_dict"]), tensors)
        return JSONResponse({"success": True, "error_message": None,
                             "loaded_adapters": loaded()})

    @app.post("/unload_lora_adapter")
    @_json_errors
    async def unload_lora_adapter(request: Request):
        b = await _body(request)
        sglang_api.check_body("/unload_lora_adapter", b)
        await asyncio.to_thread(engine.unload_adapter, str(b["lora_name"]))
        return JSONResponse({"success": True, "error_message": None,
                             "loaded_adapters": loaded()})

    @app.post("/update_weight_version")
    @_json_errors
    async def update_weight_version(request: Request):
        b = await _body(request)
        sglang_api.check_body("/update_weight_version", b)
        if b.get("abort_all_requests", True):
            engine.abort_all()
        await asyncio.to_thread(engine.set_weight_version, str(b["new_version"]))
        return JSONResponse({"success": True, "new_version": str(b["new_version"]),
                             "message": f"Weight version updated to {b['new_version']}"})
