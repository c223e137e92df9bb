"""HTTP client of an engine: an SGLang server or our hf engine (same routes, same JSON).

Used by the trainer (weight-sync and control routes) and the evaluator; rollout workers keep
many requests in flight through the asyncio client of engines/async_client.py, which shares
ClientBase's bodies and answers. Only SGLang's native
API is used, so the same code works against `python -m sglang.launch_server`; the one hf-only
route is `weights_checksum` (bit-exact tests), which SGLang servers do not have.

Every call has a timeout; every failure raises EngineError naming the URL, the route and the
server's message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
import logging
import time
from typing import Any, Callable, Optional

import httpx
import orjson

from relax_slurm.errors import EngineAborted, EngineDown, EngineError, EngineUnreachable
from relax_slurm.engines import sglang_api
from relax_slurm.engines.served_adapter import ServedAdapter, by_own_label, names_missing

# httpx logs every request at INFO: thousands of lines per step in a role's log
logging.getLogger("httpx").setLevel(logging.WARNING)
# SGLang's sampling_params: one map for every input, or one per input
SamplingParams = dict[str, Any] | list[dict[str, Any]]


@dataclass
class GenerateResult:
    """One generated sequence: tokens, their log-probs, why it stopped, the weights that made it."""

    output_ids: list[int]
    logprobs: list[float]
    """Log-prob of each output token (empty when return_logprob=False)."""
    finish_reason: str
    """stop (EOS, stop token or stop string), length (max_new_tokens) or abort."""
    weight_version: Optional[str]
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    """Log-prob of each input token from logprob_start_len on (the very first token's is None);
    empty unless the request set logprob_start_len >= 0."""
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)
    """(version, start, end) spans of output_ids, end exclusive (meta_info.weight_versions):
    more than one when the weights changed while the sequence was generated (a pause in
    retract or in_place mode); empty when the server did not report them."""
    routed_experts: Optional[str] = None
    """meta_info.routed_experts (MoE models, asked with return_routed_experts): base64 int32
    expert ids [prompt + output - 1 - routed_start, layers, top-k], decoded by
    relax_slurm.routing.shape."""
    routed_start: int = 0
    """The position of routed_experts' first row: the request's routed_experts_start_len."""

    def versions(self) -> list[int]:
        """The policy versions whose weights sampled this sequence's tokens, oldest first (the
        staleness rule judges the oldest)."""
        if self.weight_versions:
            return [int(v) for v, _, _ in self.weight_versions]
        return [] if self.weight_version is None else [int(self.weight_version)]


def parse_generate_item(item: dict[str, Any]) -> GenerateResult:
    """One element of a /generate response (SGLang shape) -> GenerateResult."""
    meta = item.get("meta_info") or {}
    token_logprobs = meta.get("output_token_logprobs")  # [[logprob, token_id, text|None], ...]
    if token_logprobs is not None:
        # the sampled tokens themselves, aligned one to one with their log-probs
        output_ids = [int(e[1]) for e in token_logprobs]
        logprobs = [float(e[0]) for e in token_logprobs]
    else:
        output_ids = [int(t) for t in item.get("output_ids") or []]
        logprobs = []
    finish = meta.get("finish_reason")
    finish_type = finish.get("type", "") if isinstance(finish, dict) else str(finish or "")
    version = meta.get("weight_version")
    # [[logprob | None, token_id, text | None], ...] from logprob_start_len on
    inputs = [None if e[0] is None else float(e[0]) for e in meta.get("input_token_logprobs") or []]
    spans = [(str(s["version"]), int(s["start"]), int(s["end"]))
             for s in meta.get("weight_versions") or []]
    return GenerateResult(output_ids=output_ids, logprobs=logprobs, finish_reason=finish_type,
                          weight_version=None if version is None else str(version),
                          text=item.get("text", ""), meta_info=meta, input_logprobs=inputs,
                          weight_versions=spans, routed_experts=meta.get("routed_experts"))


def excluding(lps: list[float], ids_logprobs: Optional[list], url: str) -> list[float]:
    """Log-probs of input tokens 1.. renormalized without some ids, from their log-probs at
    each position (meta_info.input_token_ids_logprobs: None for the first position, then
    [[logprob, id, text], ...]): log p - log(1 - sum of their p)."""
    if not ids_logprobs or len(ids_logprobs) != len(lps) + 1:
        raise EngineError(f"engine {url}/generate: no input_token_ids_logprobs for each input "
                          "position (token_ids_logprob)")
    out = []
    for lp, entries in zip(lps, ids_logprobs[1:]):
        mass = min(sum(math.exp(float(e[0])) for e in entries), 1.0 - 1e-12)
        out.append(float(lp) - math.log1p(-mass))
    return out


def raise_if_aborted(results: list[GenerateResult], url: str) -> list[GenerateResult]:
    """`results`, unless one was aborted (EngineAborted): a truncated sequence must never be
    scored or trained on."""
    aborted = [r for r in results if r.finish_reason == "abort"]
    if aborted:
        reason = aborted[0].meta_info.get("finish_reason")
        why = reason.get("message") if isinstance(reason, dict) else reason
        raise EngineAborted(f"engine {url}/generate: {len(aborted)} of {len(results)} "
                            f"sequences aborted ({why})")
    return results


def json_body(body: Any) -> dict[str, Any]:
    """httpx keywords for a JSON request body (none for None), encoded by orjson: a step's
    /generate of 512 prompts and its answer are the largest JSON the run handles, and the
    standard library's encoder and decoder took ~3x as long on them."""
    if body is None:
        return {}
    return {"content": orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS),
            "headers": {"content-type": "application/json"}}


def _server_message(resp: httpx.Response) -> str:
    """The error text of a response: {message}, {error: {message}}, {detail} or the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:2000]
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]


def media_fields(media: Optional[list[dict[str, list[str]]]], n: int) -> dict[str, Any]:
    """SGLang's batch form of the media fields: `image_data` / `video_data` / `audio_data`, one
    list of items (file names or base64) per input, [] for an input without that kind."""
    if not media:
        return {}
    if len(media) != n:
        raise ValueError(f"media for {len(media)} inputs, expected {n}")
    kinds = sorted({k for m in media for k, v in m.items() if v})
    return {f"{k}_data": [list(m.get(k) or []) for m in media] for k in kinds}


class ClientBase:
    """What the sync client (here) and the async one (engines/async_client.py) share: the
    request bodies and the reading of answers and errors."""

    def __init__(self, url: str, timeout_s: float, lora_path: Optional[str] = None,
                 adapter: Optional[ServedAdapter] = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.lora_path = lora_path
        """The adapter every /generate names; None: the base (or `adapter`'s)."""
        self.adapter = adapter
        """model.lora's adapter-only sync: each /generate names the newest version's adapter
        this engine holds (engines/served_adapter.py)."""

    def _check(self, route: str, resp: httpx.Response) -> httpx.Response:
        if resp.status_code == 503:  # not serving now (restoring its weights): try again later
            raise EngineUnreachable(f"engine {self.url}{route}: HTTP 503: "
                                    f"{_server_message(resp)}")
        if resp.status_code >= 400:
            raise EngineError(f"engine {self.url}{route}: HTTP {resp.status_code}: "
                              f"{_server_message(resp)}")
        return resp

    def _json(self, route: str, resp: httpx.Response) -> Any:
        self._check(route, resp)
        try:
            body = orjson.loads(resp.content)
        except ValueError as e:  # (orjson.JSONDecodeError is one)
            raise EngineError(f"engine {self.url}{route}: answer is not JSON: "
                              f"{resp.text[:200]!r}") from e
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"engine {self.url}{route}: {body.get('message', body)}")
        return body

    def _error(self, route: str, e: Exception) -> EngineError:
        if isinstance(e, httpx.TimeoutException):
            return EngineUnreachable(f"engine {self.url}{route}: no answer within "
                                     f"{self.timeout_s}s ({type(e).__name__})")
        cls = EngineUnreachable if isinstance(e, httpx.TransportError) else EngineError
        return cls(f"engine {self.url}{route}: {type(e).__name__}: {e}")

    @staticmethod
    def _generate_body(input_ids: list[list[int]], sampling_params: SamplingParams,
                       return_logprob: bool, logprob_start_len: Optional[int] = None,
                       media: Optional[list[dict[str, list[str]]]] = None,
                       routed_experts: bool = False, routed_start: int = 0,
                       lora_path: Optional[str] = None,
                       token_ids_logprob: Sequence[int] = ()) -> dict[str, Any]:
        body = {"input_ids": [list(map(int, ids)) for ids in input_ids],
                "sampling_params": ([dict(p) for p in sampling_params]
                                    if isinstance(sampling_params, list)
                                    else dict(sampling_params)),
                "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = int(logprob_start_len)
        if routed_experts:  # from 0 the whole sequence's: the trainer replays the prompt's too;
            # a later turn of a multi-turn sample asks for the positions no turn covered yet
            body.update(return_routed_experts=True, routed_experts_start_len=int(routed_start))
        body.update(media_fields(media, len(input_ids)))
        if lora_path is not None:
            body["lora_path"] = lora_path
        if token_ids_logprob:  # the log-probs of these ids at every position too
            body["token_ids_logprob"] = [int(t) for t in token_ids_logprob]
        return body

    def _healthy(self, resp: httpx.Response) -> bool:
        """GET /health's answer: True for 200, EngineError otherwise (the sync and async
        clients' health share it)."""
        self._check("/health", resp)
        if resp.status_code != 200:
            raise EngineError(f"engine {self.url}/health: HTTP {resp.status_code}")
        return True

    def _info(self, route: str, resp: httpx.Response) -> Optional[dict[str, Any]]:
        """An info route's body; None on a 404 (try its older name, DEPRECATED_ROUTE)."""
        return None if resp.status_code == 404 else self._json(route, resp)

    def _parse_generate(self, body: Any, n: int) -> list[GenerateResult]:
        items = body if isinstance(body, list) else [body]
        if len(items) != n:
            raise EngineError(f"engine {self.url}/generate: {len(items)} results for {n} inputs")
        return [parse_generate_item(item) for item in items]


class EngineClient(ClientBase):
    """Synchronous client (thread-safe: httpx.Client shares its connection pool)."""

    def __init__(self, url: str, timeout_s: float = 300.0, lora_path: Optional[str] = None,
                 adapter: Optional[ServedAdapter] = None) -> None:
        super().__init__(url, timeout_s, lora_path, adapter)
        # no keep-alive: these calls are seconds apart (weight updates, control), longer than
        # servers keep idle connections, and a weight update must not be retried blindly
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  headers=sglang_api.auth_headers(),
                                  limits=httpx.Limits(max_keepalive_connections=0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, route: str, body: Any = None,
              timeout_s: Optional[float] = None) -> httpx.Response:
        try:
            return self._http.request(method, route, **json_body(body),
                                      timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise self._error(route, e) from e

    def health(self, timeout_s: float = 10.0) -> bool:
        """True when GET /health answers 200; raises EngineError otherwise (down, 503, timeout)."""
        try:
            resp = self._http.get("/health", timeout=timeout_s)
        except httpx.HTTPError as e:
            raise self._error("/health", e) from e
        return self._healthy(resp)

    def alive(self, timeout_s: float = 5.0) -> bool:
        """True when the server and its scheduler answer, paused or not: GET /server_info
        (SGLang fetches the scheduler's internal state for it). Not /health: SGLang's
        generates one token, which waits while generation is paused and answers 503 after
        20 s, so a paused engine (a weight sync, a train step with released memory) would read
        as hung. Raises EngineError otherwise (down, frozen, timeout)."""
        self._check("/server_info", self._call("GET", "/server_info", timeout_s=timeout_s))
        return True

    def answers(self, timeout_s: float = 5.0) -> bool:
        """True when the HTTP server answers GET /model_info (SGLang's tokenizer manager, without
        its scheduler): during a sync an engine's scheduler is inside the broadcast's receive
        and answers nothing else, so this tells a waiting engine from a frozen or dead one."""
        self._check("/model_info", self._call("GET", "/model_info", timeout_s=timeout_s))
        return True

    def ready(self, timeout_s: float = 5.0) -> bool:
        """GET /ready: True when the engine takes new requests now, False when it is up but
        paused (or still starting); EngineError when it does not answer."""
        resp = self._call("GET", "/ready", timeout_s=timeout_s)
        if resp.status_code == 503:
            return False
        self._check("/ready", resp)
        return True

    def _get_info(self, route: str) -> dict[str, Any]:
        """GET /model_info or /server_info, else their older names; a 404 on both is an
        EngineError (a server that does not speak the protocol), not an engine down."""
        for name in (route, sglang_api.DEPRECATED_ROUTE[route]):
            body = self._info(name, self._call("GET", name))
            if body is not None:
                return body
        raise EngineError(f"engine {self.url}: neither {route} nor "
                          f"{sglang_api.DEPRECATED_ROUTE[route]} exists (HTTP 404): not an "
                          f"SGLang server of {sglang_api.SUPPORTED_SGLANG}?")

    def model_info(self) -> dict[str, Any]:
        return self._get_info("/model_info")

    def server_info(self) -> dict[str, Any]:
        return self._get_info("/server_info")

    def protocol(self) -> sglang_api.ServerProtocol:
        """The server's SGLang release (or the hf engine's), checked against the range."""
        return sglang_api.server_protocol(self.server_info(), self.url)

    def weight_version(self) -> Optional[str]:
        version = self.model_info().get("weight_version")
        return None if version is None else str(version)

    def generate(self, input_ids: list[list[int]], sampling_params: SamplingParams,
                 return_logprob: bool = True,
                 media: Optional[list[dict[str, list[str]]]] = None) -> list[GenerateResult]:
        """One batch request; results in the order of input_ids. `media`: per input
        {kind: [file name or base64, ...]}, sent as SGLang's image_data / audio_data."""
        if not input_ids:
            return []

        def send(lora_path: Optional[str]) -> list[GenerateResult]:
            body = self._generate_body(input_ids, sampling_params, return_logprob, media=media,
                                       lora_path=lora_path)
            return self._parse_generate(
                self._json("/generate", self._call("POST", "/generate", body)), len(input_ids))
        if self.adapter is None:
            return send(self.lora_path)
        return by_own_label(self, send)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> dict[str, Any]:
        """Blocks until the whole group formed (the trainer must join concurrently)."""
        body = sglang_api.init_group_body(master_address, master_port, rank_offset,
                                          world_size, group_name, backend)
        return self._json("/init_weights_update_group",
                          self._call("POST", "/init_weights_update_group", body))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._json("/destroy_weights_update_group",
                          self._call("POST", "/destroy_weights_update_group",
                                     {"group_name": group_name}))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: Optional[str] = None,
                                        flush_cache: bool = True,
                                        load_format: Optional[str] = None) -> dict[str, Any]:
        """Blocks until the engine received and loaded every tensor (broadcast concurrently)."""
        body = sglang_api.update_weights_body(names, dtypes, shapes, group_name,
                                              weight_version, flush_cache, load_format)
        return self._json("/update_weights_from_distributed",
                          self._call("POST", "/update_weights_from_distributed", body))

    def update_weights_from_tensor(self, payloads: list[str],
                                   weight_version: Optional[str] = None,
                                   flush_cache: bool = True,
                                   load_format: Optional[str] = None) -> dict[str, Any]:
        """Blocks until the engine opened the tensors `payloads` reference (one per TP rank,
        weightsync/ipc.py) and loaded them."""
        route = "/update_weights_from_tensor"
        body = sglang_api.tensor_update_body(payloads, weight_version, flush_cache, load_format)
        return self._json(route, self._call("POST", route, body))

    def load_lora_adapter_from_tensors(self, name: str, config: dict[str, Any], payload: str,
                                       tp_size: int = 1) -> dict[str, Any]:
        """Load adapter `name` (PEFT's adapter_config as `config`; `payload`: its tensors as
        weightsync/adapter.py serializes them) next to the base weights."""
        body = sglang_api.load_adapter_body(name, config, payload, tp_size)
        route = "/load_lora_adapter_from_tensors"
        return self._json(route, self._call("POST", route, body))

    def unload_lora_adapter(self, name: str) -> bool:
        """Unload adapter `name` once no request uses it; False when the engine holds none of
        that name (restarted since it was loaded)."""
        route = "/unload_lora_adapter"
        try:
            self._json(route, self._call("POST", route, {"lora_name": name}))
        except EngineError as e:
            if names_missing(str(e)) and not isinstance(e, EngineUnreachable):
                return False
            raise
        return True

    def update_weight_version(self, version: str) -> None:
        """Label the weights served from now on (an adapter load does not)."""
        route = "/update_weight_version"
        self._json(route, self._call("POST", route, sglang_api.version_body(version)))

    def begin_weight_update(self) -> None:
        """Open the weight-update session the updates of one sync run in (SGLang 0.5.21+)."""
        self._json("/begin_weight_update", self._call("POST", "/begin_weight_update", {}))

    def end_weight_update(self) -> None:
        self._json("/end_weight_update", self._call("POST", "/end_weight_update", {}))

    def pause_generation(self, mode: str = "retract") -> None:
        """Stop generating: retract (running requests back to the queue, continued after
        /continue_generation), abort (they end with finish_reason abort) or in_place."""
        self._check("/pause_generation",
                    self._call("POST", "/pause_generation", sglang_api.pause_body(mode)))

    def continue_generation(self) -> None:
        self._check("/continue_generation", self._call("POST", "/continue_generation", {}))

    def flush_cache(self) -> None:
        self._check("/flush_cache", self._call("POST", "/flush_cache"))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one request by id, or every request in flight (they finish with abort)."""
        self._check("/abort_request", self._call("POST", "/abort_request",
                                                 sglang_api.abort_body(rid, abort_all)))

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Colocated placement: free the engine's GPU memory (weights, KV cache) for training."""
        self._check("/release_memory_occupation",
                    self._call("POST", "/release_memory_occupation",
                               sglang_api.memory_body(tags)))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Colocated placement: take the memory back before the next rollout."""
        self._check("/resume_memory_occupation",
                    self._call("POST", "/resume_memory_occupation",
                               sglang_api.memory_body(tags)))

    def health_generate(self, timeout_s: float = 60.0) -> bool:
        """GET /health_generate: the server generates one token (a deeper check than /health)."""
        self._check("/health_generate", self._call("GET", "/health_generate",
                                                   timeout_s=timeout_s))
        return True

    def weights_checksum(self) -> dict[str, str]:
        """hf engine only: {parameter name: sha256 hex of its raw bytes}."""
        return self._json("/weights_checksum", self._call("GET", "/weights_checksum"))["checksums"]


def probe_alive(http: httpx.Client, url: str) -> bool:
    """`EngineClient.alive`'s answer (GET URL/server_info: 200, paused or not) on a client the
    caller keeps with the engines' key, for watchers that probe every engine often (one httpx
    client per probe would load the CA bundle each time)."""
    try:
        return http.get(url.rstrip("/") + "/server_info").status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_healthy(urls: list[str], timeout_s: float, poll_s: float = 0.5,
                       between_polls: Callable[[], None] = lambda: None,
                       paused_ok: bool = False) -> None:
    """Block until every engine answers /health (roles start together, so an engine may still
    be loading its model); EngineDown names the first one still down after timeout_s. With
    `paused_ok` (a cohort re-forming after a failed sync, whose engines stay paused until the
    resend) an engine that answers while paused counts too (`EngineClient.alive`).

    One client per engine for the whole wait: creating an httpx client loads the CA bundle
    (~0.1 CPU-s), which at two polls a second was a quarter of a core during start-up.
    `between_polls` runs before every round (the launcher raises there when a role died)."""
    deadline = time.monotonic() + timeout_s
    clients = {url: EngineClient(url, timeout_s=10.0) for url in urls}
    try:
        pending = list(urls)
        while True:
            between_polls()
            errors: dict[str, EngineError] = {}
            for url in pending:
                try:
                    if paused_ok:
                        clients[url].alive(timeout_s=5.0)
                    else:
                        clients[url].health(timeout_s=5.0)
                except EngineError as e:
                    errors[url] = e
            pending = [u for u in pending if u in errors]
            if not pending:
                return
            if time.monotonic() > deadline:
                url = pending[0]
                raise EngineDown(url, f"{errors[url]} (still down after "
                                      f"rollout.startup_timeout_s={timeout_s}s)")
            time.sleep(poll_s)
    finally:
        for client in clients.values():
            client.close()
