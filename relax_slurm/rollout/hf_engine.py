"""A CPU inference server wrapping transformers, speaking SGLang's native HTTP API.

Routes and JSON shapes follow sglang/srt/entrypoints/http_server.py and managers/io_struct.py
(GenerateReqInput, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput), so a
rollout worker or trainer cannot tell this server from `python -m sglang.launch_server`:

  POST /generate                      text | input_ids (one or a batch), sampling_params,
                                      return_logprob, logprob_start_len, image_data,
                                      video_data, audio_data
                                      -> {text, output_ids, meta_info} or a list
  GET  /health, /health_generate      200 when the generation thread is alive, else 503
  GET  /get_model_info                {model_path, tokenizer_path, is_generation, ...}
  GET  /get_weight_version            {weight_version}
  POST /init_weights_update_group     join the trainer's weight-sync group (blocks until formed)
  POST /destroy_weights_update_group  leave it
  POST /update_weights_from_distributed  receive one broadcast per name from rank 0, in order
                                      (load_format=flattened_bucket: one of them all)
  POST /flush_cache                   no prefix cache here: a no-op answering 200
  POST /pause_generation, /continue_generation
  GET  /get_server_info               hf extension: batching counters
  GET  /weights_checksum              hf extension: sha256 of every parameter's raw bytes

Prefill log-probs (how a teacher scores a student's response): `return_logprob=true` with
`logprob_start_len=k >= 0` adds `meta_info.input_token_logprobs`, one `[logprob, token_id, None]`
per input position from k on, the first input token's log-prob being None, as SGLang does;
with `max_new_tokens=0` nothing is generated and only the prefill runs.

Multimodal models (Qwen2.5-VL, Qwen3-VL, Qwen2-Audio, ...: `relax_slurm.modeling`): `image_data`
/ `video_data` / `audio_data` as SGLang takes them (one list of items per input; an item is a
file name, a data URL or base64 bytes; a video also a folder of frames) are processed with the
model's own image processor / feature extractor (`relax_slurm.data.processor`, the code the
rollout worker runs too); each item's pad token in `input_ids` is expanded to its token count
(ids already expanded pass unchanged) and the tensors ride along with the row into the batched
`generate`.

Dynamic batching: requests queue up; one generation thread takes up to --max-batch-size
sequences (waiting up to --batch-wait-ms for more) and runs one `model.generate` with left
padding. Per-row sampling params, stop conditions and log-probs are handled by a logits
processor and a stopping criterion that share one `_BatchState`.

  python -m relax_slurm.rollout.hf_engine --model-path P --host H --port N --dtype float32 \
      --max-batch-size 1024 --batch-wait-ms 5 --torch-threads 1 --seed S --weight-version 0
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from transformers import (AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          StoppingCriteria, StoppingCriteriaList)

from relax_slurm.auth import bearer_matches
from relax_slurm.config.schema import FLATTENED_BUCKET
from relax_slurm.data.media import MODALITIES, MediaRef, from_engine
from relax_slurm.data.processor import MediaLimits, MediaProcessor, concat_tensors
from relax_slurm.data.video import VideoLimits
from relax_slurm.errors import DataError, WeightSyncError
from relax_slurm.modeling import (auto_model_class, is_multimodal, media_token_ids,
                                  mm_token_types)
from relax_slurm.rollout import sglang_api
from relax_slurm.launch.exit import exit_now
from relax_slurm.launch.heap import freeze_heap
from relax_slurm.weightsync.receiver import WeightReceiver, load_named_tensors, model_checksums

log = logging.getLogger("relax_slurm.hf_engine")

GREEDY_EPS = 1e-6
"""SGLang samples greedily (top_k=1) when temperature < 1e-6; so do we."""


# idle keep-alive connections live this long (uvicorn's 5 s default races with clients that
# reuse a connection after a pause between training steps)
KEEP_ALIVE_S = 120


PARTIAL_WEIGHTS = ("the last weight update failed midway and left a mix of two versions: "
                   "generation resumes after the next complete /update_weights_from_distributed")


class NotServing(RuntimeError):
    """The engine cannot generate now but will again (HTTP 503: the client tries later)."""


class BadRequest(ValueError):
    """The request cannot be served as sent: answered with HTTP 400 and the reason."""


@dataclass(frozen=True)
class SamplingSpec:
    """The subset of SGLang's SamplingParams the hf engine implements (same names, defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset = frozenset()
    stop: tuple = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = None
    """SGLang's per-request seed: the same seed gives the same tokens whatever else is batched."""


# SGLang sampling params accepted only at their default value (the hf engine lacks them)
_DEFAULT_ONLY = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                 "repetition_penalty": 1.0, "min_new_tokens": 0, "json_schema": None,
                 "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
                 "custom_params": None, "stop_regex": None}
_TEXT_ONLY = {"spaces_between_special_tokens"}  # affects detokenization only; ignored


def _number(params: dict, key: str, default: float, lo: float, hi: float,
            integer: bool = False) -> Any:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (integer and not float(value).is_integer()):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"sampling_params.{key}={value!r}: expected {kind}")
    if not lo <= value <= hi:
        raise BadRequest(f"sampling_params.{key}={value}: must be in [{lo}, {hi}]")
    return int(value) if integer else float(value)


def parse_sampling_params(params: Optional[dict]) -> SamplingSpec:
    """SGLang sampling_params dict -> SamplingSpec; BadRequest names the offending key."""
    if params is not None and not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    params = dict(params or {})
    known = set(SamplingSpec.__dataclass_fields__) | set(_DEFAULT_ONLY) | _TEXT_ONLY
    for key in params:
        if key not in known:
            raise BadRequest(f"unknown sampling param {key!r}")
    for key, default in _DEFAULT_ONLY.items():
        if key in params and params[key] is not None and params[key] != default:
            raise BadRequest(f"sampling_params.{key}={params[key]!r} is not supported by the hf "
                             f"engine (only {default!r})")
    top_k = _number(params, "top_k", -1, -1, 2**31, integer=True)
    if top_k == 0:
        raise BadRequest("sampling_params.top_k=0: use -1 to disable top-k")
    stop = params.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_ids = params.get("stop_token_ids") or ()
    if not all(isinstance(s, str) and s for s in stop) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("sampling_params.stop must be strings and stop_token_ids integers")
    return SamplingSpec(
        max_new_tokens=_number(params, "max_new_tokens", 128, 0, 2**31, integer=True),
        temperature=_number(params, "temperature", 1.0, 0.0, 1e6),
        top_p=_number(params, "top_p", 1.0, 1e-9, 1.0), top_k=top_k,
        min_p=_number(params, "min_p", 0.0, 0.0, 1.0),
        stop_token_ids=frozenset(stop_ids), stop=stop,
        ignore_eos=bool(params.get("ignore_eos", False)),
        skip_special_tokens=bool(params.get("skip_special_tokens", True)),
        no_stop_trim=bool(params.get("no_stop_trim", False)),
        sampling_seed=(None if params.get("sampling_seed") is None else
                       _number(params, "sampling_seed", 0, 0, 2**63 - 1, integer=True)))


def _per_item(value: Any, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def parse_generate_request(body: dict, tokenizer: Any, vocab_size: int
                           ) -> tuple[list[list[int]], list[SamplingSpec], list[bool], list[int],
                                      bool]:
    """GenerateReqInput JSON -> (prompts, specs, return_logprob flags, logprob_start_lens,
    is_batch); a start length of -1 (SGLang's default) returns no input log-probs."""
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the hf engine")
    for key in ("top_logprobs_num", "token_ids_logprob", "return_hidden_states", "input_embeds",
                "lora_path"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported by the hf engine")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("send exactly one of text or input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        prompts = [tokenizer(t)["input_ids"] for t in texts]
    else:
        is_batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        for p in prompts:
            if not isinstance(p, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise BadRequest("input_ids must be a list of ints or a list of lists of ints")
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"input_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadRequest("empty prompt: every input needs at least one token")
    n = len(prompts)
    specs = [parse_sampling_params(sp) for sp in _per_item(body.get("sampling_params"), n,
                                                           "sampling_params")]
    flags = [bool(f) for f in _per_item(body.get("return_logprob"), n, "return_logprob")]
    starts = _per_item(body.get("logprob_start_len"), n, "logprob_start_len")
    starts = [-1 if v is None else v for v in starts]
    for start, prompt in zip(starts, prompts):
        if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start < len(prompt):
            raise BadRequest(f"logprob_start_len={start!r}: must be -1 (output log-probs only) "
                             f"or an index into the input (below its length {len(prompt)})")
    return prompts, specs, flags, starts, is_batch


def parse_media(body: dict, n: int, is_batch: bool) -> list[dict[str, list[MediaRef]]]:
    """SGLang's `image_data` / `video_data` / `audio_data`: for one input an item or a list of
    items, for a batch one such entry (or null) per input -> per input {kind: [MediaRef]}."""
    out: list[dict[str, list[MediaRef]]] = [{} for _ in range(n)]
    for kind in MODALITIES:
        value = body.get(f"{kind}_data")
        if value is None:
            continue
        entries = value if is_batch else [value]
        if not isinstance(entries, list) or len(entries) != n:
            raise BadRequest(f"{kind}_data: expected one entry per input ({n})")
        for i, entry in enumerate(entries):
            items = [] if entry is None else entry if isinstance(entry, list) else [entry]
            try:
                out[i][kind] = [from_engine(kind, v, f"{kind}_data[{i}][{j}]")
                                for j, v in enumerate(items)]
            except DataError as e:
                raise BadRequest(str(e)) from e
    return out


@dataclass
class _Request:
    """One HTTP /generate call: its rows finish in any order, the future resolves once."""

    future: Future
    results: list
    remaining: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(self, index: int, item: dict) -> None:
        with self.lock:
            self.results[index] = item
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            try:
                self.future.set_result(self.results)
            except InvalidStateError:  # the HTTP side timed out and cancelled it
                pass

    def fail(self, exc: BaseException) -> None:
        try:
            self.future.set_exception(exc)
        except InvalidStateError:
            pass


@dataclass
class _Row:
    input_ids: list[int]
    spec: SamplingSpec
    return_logprob: bool
    request: _Request
    index: int
    logprob_start_len: int = -1
    """>= 0: also return the log-probs of the input tokens from this position on."""
    mm: Optional[dict] = None
    """Processed media of this row (forward kwargs as numpy arrays), or None for text."""

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def logprob_temperature(self) -> float:
        # greedy rows keep temperature 1 for their log-probs, as SGLang does
        t = self.spec.temperature
        return 1.0 if t < GREEDY_EPS else t


class _BatchState:
    """Per-row outputs of one generate call, filled step by step."""

    def __init__(self, rows: list[_Row], eos_ids: set[int], tokenizer: Any,
                 device: torch.device) -> None:
        self.rows = rows
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.device = device
        temps = [r.spec.temperature for r in rows]
        self.greedy = torch.tensor([t < GREEDY_EPS for t in temps], device=device)
        # greedy rows keep temperature 1 for their log-probs, as SGLang does
        self.temperature = torch.tensor([1.0 if t < GREEDY_EPS else t for t in temps],
                                        dtype=torch.float32, device=device)[:, None]  # [B, 1]
        self.out_ids: list[list[int]] = [[] for _ in rows]
        self.logprobs: list[list[float]] = [[] for _ in rows]
        self.finish: list[Optional[dict]] = [None for _ in rows]
        # seeded rows draw from their own generator, so their tokens do not depend on what else
        # is in the batch or on the engine's history (exact resume relies on this)
        self.generators = [None if r.spec.sampling_seed is None else
                           torch.Generator(device=device).manual_seed(r.spec.sampling_seed)
                           for r in rows]
        self.last_scaled: Optional[torch.Tensor] = None  # [B, V] logits / temperature, this step
        self.last_lse: Optional[torch.Tensor] = None  # [B] their logsumexp

    def finish_reason(self, i: int) -> Optional[dict]:
        """SGLang's Req.check_finished order: length first, then stop tokens, then stop strings."""
        spec, out = self.rows[i].spec, self.out_ids[i]
        if len(out) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        last = out[-1]
        if not spec.ignore_eos and (last in spec.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if spec.stop:
            text = self.tokenizer.decode(out, skip_special_tokens=spec.skip_special_tokens)
            for s in spec.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        return None


def inverse_cdf_sample(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [R, V] from uniforms `u` [R] in [0, 1): the first token
    whose softmax CDF exceeds u (a -inf logit is never drawn). Returns [R, 1] indices."""
    # float64: the CDF of a 150k-token vocabulary stays exact enough to sample from
    cdf = torch.softmax(logits, dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]
    # below the total (a u that rounded up to 1.0 must not run past the last possible token);
    # right=True skips zero-probability tokens (flat CDF), also when u is exactly 0
    v = torch.minimum(u.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).to(logits.device)


class _RowSampler(LogitsProcessor):
    """Per-row temperature, top-k, top-p, min-p; records the log-probs SGLang would return."""

    def __init__(self, state: _BatchState, banned_ids: tuple[int, ...] = ()) -> None:
        self.state = state
        self.banned = list(banned_ids)  # media pad tokens: input-only, never sampled
        specs = [r.spec for r in state.rows]
        self.top_k = [1 if g else (s.top_k if s.top_k > 0 else 0)
                      for g, s in zip(state.greedy.tolist(), specs)]  # 0 = no top-k
        self.top_p = torch.tensor([s.top_p for s in specs], device=state.device)[:, None]
        self.min_p = torch.tensor([s.min_p for s in specs], device=state.device)[:, None]
        self.needs_filter = (any(k > 0 for k in self.top_k) or any(s.top_p < 1.0 for s in specs)
                             or any(s.min_p > 0.0 for s in specs))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scaled = scores.float() / self.state.temperature  # [B, V]
        if self.banned:
            scaled[:, self.banned] = float("-inf")
        # SGLang (default, SGLANG_RETURN_ORIGINAL_LOGPROB unset) returns log-probs of the
        # temperature-scaled logits, before top-k/top-p/min-p truncation; we do the same:
        # logprob(token) = scaled[token] - logsumexp(scaled), gathered once the token is sampled
        self.state.last_scaled = scaled
        self.state.last_lse = torch.logsumexp(scaled, dim=-1)  # [B]
        filtered = self._filter(scaled) if self.needs_filter else scaled
        return self._draw_seeded(filtered)

    def _draw_seeded(self, filtered: torch.Tensor) -> torch.Tensor:
        """Seeded rows: sample here with the row's generator and leave generate() one choice.

        Each seeded row takes one uniform from its own generator (a cheap loop) and the
        inverse-CDF lookup runs for all of them at once: a per-row softmax + multinomial + fill
        loop was ~15% of the engine's CPU at 512 rows per batch.
        """
        gens = self.state.generators
        greedy = self.state.greedy.tolist()
        rows = [i for i, gen in enumerate(gens) if gen is not None and not greedy[i]]
        if not rows:
            return filtered
        u = torch.stack([torch.rand((), generator=gens[i], dtype=torch.float64) for i in rows])
        tokens = inverse_cdf_sample(filtered[rows], u)
        out = filtered.clone()
        index = torch.tensor(rows, device=filtered.device)
        out[index] = float("-inf")
        out[index[:, None], tokens] = 0.0
        return out

    def _filter(self, scaled: torch.Tensor) -> torch.Tensor:
        vocab = scaled.shape[-1]
        vals, idx = scaled.sort(dim=-1, descending=True)  # [B, V]
        pos = torch.arange(vocab, device=scaled.device)[None, :]
        k = torch.tensor([kk if kk > 0 else vocab for kk in self.top_k], device=scaled.device)
        remove = pos >= k[:, None]
        probs = torch.softmax(vals.masked_fill(remove, float("-inf")), dim=-1)
        remove |= (probs.cumsum(dim=-1) - probs) > self.top_p  # keeps at least the first token
        remove |= probs < self.min_p * probs[:, :1]
        vals = vals.masked_fill(remove, float("-inf"))
        return torch.empty_like(vals).scatter_(1, idx, vals)


class _RowStopper(StoppingCriteria):
    """Called after each new token: record it and its log-prob, decide which rows are done."""

    def __init__(self, state: _BatchState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        st = self.state
        last = input_ids[:, -1]  # [B]
        lps = (st.last_scaled.gather(1, last[:, None]).squeeze(1) - st.last_lse).tolist()
        for i, (tok, lp) in enumerate(zip(last.tolist(), lps)):
            if st.finish[i] is not None:
                continue
            st.out_ids[i].append(tok)
            st.logprobs[i].append(lp)
            st.finish[i] = st.finish_reason(i)
        return torch.tensor([f is not None for f in st.finish], dtype=torch.bool,
                            device=input_ids.device)


_KEEP_DTYPE = frozenset({"second_per_grid_ts"})  # media tensors not cast to the model's dtype


class HFEngine:
    """The model, the request queue and the generation thread."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str], dtype: str, device: str,
                 max_batch_size: int, batch_wait_ms: float, weight_version: str,
                 sync_timeout_s: float, media_limits: Optional[MediaLimits] = None) -> None:
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.model = auto_model_class(model_path).from_pretrained(
            model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.media = (MediaProcessor(model_path, self.tokenizer.get_vocab(), media_limits)
                      if is_multimodal(model_path) else None)
        self.banned_ids = media_token_ids(self.model.config)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, *sorted(self.eos_ids), 0)
                           if i is not None)
        # The model's own generation_config (top_k=20, temperature=0.6, eos ids, ...) would be
        # merged into every call; per-row sampling is ours, so make the defaults neutral.
        self.model.generation_config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=self.pad_id,
            eos_token_id=None, bos_token_id=None)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.weight_version = str(weight_version)
        self.receiver = WeightReceiver(sync_timeout_s)
        self.sync_timeout_s = sync_timeout_s
        self.stats = {"num_batches": 0, "num_sequences": 0, "max_batch_seen": 0}
        self._pending: deque[_Row] = deque()
        self._cond = threading.Condition()
        self._paused = False
        self.partial_weights = False
        self.released: set[str] = set()
        """Memory regions let go by /release_memory_occupation (colocated placement); CPU
        frees nothing, but generation is refused until resumed, as SGLang cannot generate
        without its weights and KV cache."""
        self._busy = False  # a batch was taken from the queue and is not delivered yet
        self._stop = False
        self._model_lock = threading.Lock()  # held by a generate call or a weight update
        self._thread = threading.Thread(target=self._loop, name="hf-generate", daemon=True)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        config = self.model.config
        text_config = getattr(config, "text_config", None)  # multimodal models keep it there
        for src in (self.tokenizer.eos_token_id, getattr(config, "eos_token_id", None),
                    getattr(text_config, "eos_token_id", None),
                    getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids

    # ---- queue and generation thread ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def process_media(self, prompts: list[list[int]], media: list[dict[str, list[MediaRef]]]
                      ) -> tuple[list[list[int]], list[Optional[dict]]]:
        """Each input's ids with its media pads expanded, and its processed tensors (None for
        text); inputs with the same ids and media (a group's samples) are processed once."""
        if not any(any(m.values()) for m in media):
            return prompts, [None] * len(prompts)
        if self.media is None:
            raise BadRequest(f"image_data/video_data/audio_data sent, but {self.model_path} is "
                             "a text model")
        done: dict[tuple, Any] = {}
        ids_out, mm_out = [], []
        for i, (ids, items) in enumerate(zip(prompts, media)):
            if not any(items.values()):
                ids_out.append(ids)
                mm_out.append(None)
                continue
            key = (tuple(ids), tuple((k, r.path, r.data) for k, rs in items.items() for r in rs))
            if key not in done:
                try:
                    done[key] = self.media.process(ids, items, where=f"input {i}")
                except DataError as e:
                    raise BadRequest(str(e)) from e
            ids_out.append(done[key].input_ids)
            mm_out.append(done[key].tensors)
        return ids_out, mm_out

    def submit(self, prompts: list[list[int]], specs: list[SamplingSpec],
               logprob_flags: list[bool], logprob_start_lens: Optional[list[int]] = None,
               mm: Optional[list[Optional[dict]]] = None) -> Future:
        """Queue one request's sequences; the future resolves to their response items."""
        req = _Request(future=Future(), results=[None] * len(prompts), remaining=len(prompts))
        starts = logprob_start_lens or [-1] * len(prompts)
        mm = mm or [None] * len(prompts)
        rows = [_Row(ids, spec, lp, req, i, start, m) for i, (ids, spec, lp, start, m)
                in enumerate(zip(prompts, specs, logprob_flags, starts, mm))]
        queued = []
        for row in rows:
            if row.spec.max_new_tokens == 0 and not row.wants_input_logprobs:  # nothing to run
                req.deliver(row.index, self._item(row, [], [], {"type": "length", "length": 0}))
            else:
                queued.append(row)
        with self._cond:
            self._pending.extend(queued)
            self._cond.notify_all()
        return req.future

    def _next_batch(self) -> list[_Row]:
        with self._cond:
            if not self._pending or self._paused:
                self._cond.wait(timeout=0.5)
                return []
            # dynamic batching: wait a little for more sequences to arrive
            deadline = time.monotonic() + self.batch_wait_s
            while len(self._pending) < self.max_batch_size and not self._paused:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            if self._paused:
                return []
            n = min(self.max_batch_size, len(self._pending))
            self._busy = True
            return [self._pending.popleft() for _ in range(n)]

    def _loop(self) -> None:
        while not self._stop:
            rows = self._next_batch()
            if not rows:
                continue
            try:
                self._run_batch(rows)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run_batch(self, rows: list[_Row]) -> None:
        with self._model_lock:  # a weight update waits for this batch to finish
            version = self.weight_version
            if self.partial_weights:  # queued while an update that then failed held the lock
                for row in rows:
                    row.request.fail(NotServing(PARTIAL_WEIGHTS))
                return
            try:
                to_generate = [r for r in rows if r.spec.max_new_tokens > 0]
                outputs = dict(zip(map(id, to_generate), self._generate(to_generate)
                                   if to_generate else []))
                inputs = self._input_logprobs([r for r in rows if r.wants_input_logprobs])
            except Exception as e:  # a bad batch fails its requests, not the server
                log.exception("generate failed for a batch of %d", len(rows))
                for row in rows:
                    row.request.fail(e)
                return
        prefill_only = ([], [], {"type": "length", "length": 0})
        for row in rows:
            ids, lps, finish = outputs.get(id(row), prefill_only)
            row.request.deliver(row.index, self._item(row, ids, lps, finish, version,
                                                      inputs.get(id(row))))

    @torch.no_grad()
    def _input_logprobs(self, rows: list[_Row]) -> dict[int, list[Optional[float]]]:
        """Per row (by id): log-probs of its input tokens from logprob_start_len on, the first
        input token's being None; one teacher-forced forward per chunk of rows."""
        out: dict[int, list[Optional[float]]] = {}
        for lo in range(0, len(rows), self.max_batch_size):
            chunk = rows[lo:lo + self.max_batch_size]
            width = max(len(r.input_ids) for r in chunk)
            # right padding: real tokens keep positions 0..L-1 and never attend to the padding
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [B, L]
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, row in enumerate(chunk):
                input_ids[i, :len(row.input_ids)] = torch.tensor(row.input_ids)
                attention_mask[i, :len(row.input_ids)] = 1
            input_ids = input_ids.to(self.device)
            logits = self.model(input_ids=input_ids,
                                attention_mask=attention_mask.to(self.device),
                                use_cache=False,
                                **self._mm_kwargs(chunk, input_ids)).logits  # [B, L, V]
            for i, row in enumerate(chunk):
                n = len(row.input_ids)
                scaled = logits[i, :n - 1].float() / row.logprob_temperature  # [L-1, V]
                targets = input_ids[i, 1:n][:, None]
                lps = (scaled.gather(1, targets).squeeze(1) - torch.logsumexp(scaled, -1))
                out[id(row)] = [None, *lps.tolist()][row.logprob_start_len:]
        return out

    def _mm_kwargs(self, rows: list[_Row], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch's media tensors: each row's, concatenated in row order (the order of their
        pads in the flattened ids); pixels and features in the model's dtype (a video's seconds
        per frame pair stay float32, as in the trainer: they scale positions); and the token
        types M-RoPE models place media by (`relax_slurm.modeling.mm_token_types`)."""
        per_row = [r.mm for r in rows if r.mm]
        if not per_row:
            return {}
        dtype = next(self.model.parameters()).dtype
        media = {k: (t.to(dtype) if t.is_floating_point() and k not in _KEEP_DTYPE else t
                     ).to(self.device)
                 for k, t in ((k, torch.from_numpy(v)) for k, v in concat_tensors(per_row).items())}
        return {**media, **mm_token_types(self.model, input_ids, media)}

    @torch.no_grad()
    def _generate(self, rows: list[_Row]) -> list[tuple[list[int], list[float], dict]]:
        batch, width = len(rows), max(len(r.input_ids) for r in rows)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, L] left-padded
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.input_ids):] = torch.tensor(row.input_ids)
            attention_mask[i, width - len(row.input_ids):] = 1
        state = _BatchState(rows, self.eos_ids, self.tokenizer, self.device)
        input_ids = input_ids.to(self.device)
        self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask.to(self.device),
            **self._mm_kwargs(rows, input_ids),
            max_new_tokens=max(r.spec.max_new_tokens for r in rows),
            logits_processor=LogitsProcessorList([_RowSampler(state, self.banned_ids)]),
            stopping_criteria=StoppingCriteriaList([_RowStopper(state)]))
        self.stats["num_batches"] += 1
        self.stats["num_sequences"] += batch
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], batch)
        return [(state.out_ids[i], state.logprobs[i],
                 state.finish[i] or {"type": "length", "length": len(state.out_ids[i])})
                for i in range(batch)]

    def _item(self, row: _Row, out_ids: list[int], logprobs: list[float], finish: dict,
              version: Optional[str] = None,
              input_logprobs: Optional[list[Optional[float]]] = None) -> dict:
        """One response element in SGLang's shape."""
        spec = row.spec
        text = self.tokenizer.decode(out_ids, skip_special_tokens=spec.skip_special_tokens)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), str) \
                and not spec.no_stop_trim:
            text = text[:text.find(finish["matched"])]
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex, "finish_reason": finish,
            "prompt_tokens": len(row.input_ids), "completion_tokens": len(out_ids),
            "cached_tokens": 0, "weight_version": version or self.weight_version,
        }
        if row.return_logprob:
            # SGLang: [logprob, token_id, token_text]; text is None unless return_text_in_logprobs
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, out_ids)]
        if input_logprobs is not None:
            tokens = row.input_ids[row.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tok, None]
                                            for lp, tok in zip(input_logprobs, tokens)]
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ---- control: pause, weights ------------------------------------------------------------

    def pause(self, mode: str) -> None:
        """Start no new batch; abort drops the queued requests (finish_reason abort).
        hf cannot stop a generate call midway, so every mode lets the batch in flight finish."""
        with self._cond:
            self._paused = True
            aborted = list(self._pending) if mode == "abort" else []
            if aborted:
                self._pending.clear()
        for row in aborted:
            finish = {"type": "abort", "message": "Abort by /pause_generation"}
            row.request.deliver(row.index, self._item(row, [], [], finish))
        self._wait_idle()

    def abort_queued(self) -> int:
        """/abort_request with abort_all: queued requests finish with abort (the batch in
        flight completes: hf cannot stop a generate call midway)."""
        with self._cond:
            aborted = list(self._pending)
            self._pending.clear()
        for row in aborted:
            finish = {"type": "abort", "message": "Abort by /abort_request"}
            row.request.deliver(row.index, self._item(row, [], [], finish))
        return len(aborted)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.sync_timeout_s
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the batch in flight did not finish within "
                                       f"{self.sync_timeout_s}s")
                self._cond.wait(timeout=left)

    def update_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       group_name: str, weight_version: Optional[str],
                       flattened: bool = False) -> None:
        """Receive (per-tensor broadcast from rank 0, in the order of names; or one of the
        flattened bucket) and load."""
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"generation held the model for more than {self.sync_timeout_s}s")
        try:
            # received in place into the parameters: a failure midway leaves a mix of two
            # versions, so the engine serves nothing until a later update completes (requests
            # queued meanwhile are refused by _run_batch; the lock keeps them out until then)
            params = dict(self.model.named_parameters(remove_duplicate=False))
            try:
                received = self.receiver.receive(names, dtypes, shapes, group_name, self.device,
                                                 into=params, flattened=flattened)
                load_named_tensors(self.model, received)
            except BaseException:
                self.partial_weights = True
                raise
            self.partial_weights = False
            if weight_version is not None:
                self.weight_version = str(weight_version)
        finally:
            self._model_lock.release()
        log.info("loaded %d tensors from group %r (weight_version %s)", len(names), group_name,
                 self.weight_version)

    def checksums(self) -> dict[str, str]:
        with self._model_lock:
            return model_checksums(self.model)


# ---- HTTP -----------------------------------------------------------------------------------

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
        body = json.loads(raw)
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
    """The SGLang routes; with `api_key`, every route but /health* wants
    `Authorization: Bearer KEY` (401 otherwise), as SGLang's --api-key."""
    app = FastAPI(title="relax-slurm hf engine")

    if api_key:
        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if (not request.url.path.startswith(sglang_api.OPEN_ROUTES)
                    and not bearer_matches(api_key, request.headers.get("authorization"))):
                return JSONResponse({"error": "missing or wrong API key (Authorization: Bearer "
                                              f"${sglang_api.API_KEY_ENV})"}, status_code=401)
            return await call_next(request)

    @app.api_route("/generate", methods=["POST", "PUT"])
    @_json_errors
    async def generate(request: Request):
        body = await _body(request)
        if engine.released:
            raise BadRequest(f"memory {sorted(engine.released)} is released: call "
                             "/resume_memory_occupation before /generate")
        if engine.partial_weights:
            raise NotServing(PARTIAL_WEIGHTS)
        prompts, specs, flags, starts, is_batch = parse_generate_request(
            body, engine.tokenizer, engine.vocab_size)
        media = parse_media(body, len(prompts), is_batch)
        prompts, mm = await asyncio.to_thread(engine.process_media, prompts, media)
        future = engine.submit(prompts, specs, flags, starts, mm)
        items = await asyncio.wait_for(asyncio.wrap_future(future), timeout=request_timeout_s)
        return JSONResponse(items if is_batch else items[0])

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive() else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {"model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return {"engine": "hf", "model_path": engine.model_path,
                "max_batch_size": engine.max_batch_size,
                "batch_wait_ms": engine.batch_wait_s * 1000.0,
                "weight_version": engine.weight_version, "paused": engine._paused,
                "memory_released": sorted(engine.released),
                "queued_sequences": len(engine._pending), "internal_states": [dict(engine.stats)]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(content="Cache flushed.\n", status_code=200)  # no prefix cache to drop

    @app.post("/pause_generation")
    @_json_errors
    async def pause_generation(request: Request):
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of abort, retract, in_place")
        await asyncio.to_thread(engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/init_weights_update_group")
    @_json_errors
    async def init_weights_update_group(request: Request):
        b = await _body(request)
        sglang_api.check_body("/init_weights_update_group", b)
        await asyncio.to_thread(engine.receiver.init_group, str(b["master_address"]),
                                int(b["master_port"]), int(b["rank_offset"]),
                                int(b["world_size"]), b.get("group_name", "weight_update_group"),
                                b.get("backend", "nccl"))
        return JSONResponse({"success": True,
                             "message": "Succeeded to initialize custom process group."})

    @app.post("/destroy_weights_update_group")
    @_json_errors
    async def destroy_weights_update_group(request: Request):
        name = (await _body(request)).get("group_name", "weight_update_group")
        if not await asyncio.to_thread(engine.receiver.destroy_group, name):
            raise BadRequest(f"no weight-update group {name!r}")
        return JSONResponse({"success": True, "message": f"Destroyed group {name}."})

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
        if not engine.receiver.has_group(group):
            raise BadRequest(f"no weight-update group {group!r}: call /init_weights_update_group")
        version = b.get("weight_version")
        await asyncio.to_thread(engine.update_weights, names, dtypes, shapes, group, version,
                                load_format == FLATTENED_BUCKET)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message})

    @app.post("/abort_request")
    @_json_errors
    async def abort_request(request: Request):
        b = await _body(request)
        sglang_api.check_body("/abort_request", b)
        # no request ids here: a single rid matches nothing, as an unknown rid in SGLang
        if b.get("abort_all"):
            await asyncio.to_thread(engine.abort_queued)
        return Response(status_code=200)

    @app.post("/release_memory_occupation")
    @_json_errors
    async def release_memory_occupation(request: Request):
        tags = _memory_tags(await _body(request), "/release_memory_occupation")
        await asyncio.to_thread(engine.pause, "in_place")  # as SGLang, after the batch in flight
        engine.released |= set(tags)
        return JSONResponse({"success": True, "message": f"released {sorted(tags)}"})

    @app.post("/resume_memory_occupation")
    @_json_errors
    async def resume_memory_occupation(request: Request):
        tags = _memory_tags(await _body(request), "/resume_memory_occupation")
        engine.released -= set(tags)
        if not engine.released:
            engine.resume()
        return JSONResponse({"success": True, "message": f"resumed {sorted(tags)}"})

    @app.get("/weights_checksum")
    async def weights_checksum() -> dict:
        checksums = await asyncio.to_thread(engine.checksums)
        return {"success": True, "weight_version": engine.weight_version, "checksums": checksums}

    return app


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="transformers inference server with SGLang's API")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="longest a /generate call may wait for its batch")
    p.add_argument("--weight-sync-timeout-s", type=float, default=300.0,
                   help="timeout of group formation, broadcasts and waiting for the model lock")
    p.add_argument("--image-min-pixels", type=int, default=None,
                   help="multimodal: smallest image size in pixels (default: the processor's)")
    p.add_argument("--image-max-pixels", type=int, default=None,
                   help="multimodal: largest image size in pixels (default: the processor's)")
    p.add_argument("--audio-sampling-rate-hz", type=int, default=16000)
    p.add_argument("--video-fps", type=float, default=2.0,
                   help="multimodal: frames kept per second of a video")
    p.add_argument("--video-min-frames", type=int, default=4)
    p.add_argument("--video-max-frames", type=int, default=768)
    p.add_argument("--video-max-pixels", type=int, default=None,
                   help="multimodal: largest video frame in pixels (default: the image limit)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.max_batch_size < 1:
        p.error("--max-batch-size must be >= 1")

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    engine = HFEngine(args.model_path, args.tokenizer_path, args.dtype, args.device,
                      args.max_batch_size, args.batch_wait_ms, args.weight_version,
                      args.weight_sync_timeout_s,
                      MediaLimits(image_min_pixels=args.image_min_pixels,
                                  image_max_pixels=args.image_max_pixels,
                                  audio_sampling_rate_hz=args.audio_sampling_rate_hz,
                                  video=VideoLimits(fps=args.video_fps,
                                                    min_frames=args.video_min_frames,
                                                    max_frames=args.video_max_frames,
                                                    max_pixels=args.video_max_pixels)))
    freeze_heap()
    engine.start()
    log.info("serving %s on %s:%d (max batch %d, wait %.1f ms)", args.model_path, args.host,
             args.port, args.max_batch_size, args.batch_wait_ms)
    try:
        app = build_app(engine, args.request_timeout_s, api_key=sglang_api.api_key())
        uvicorn.run(app, host=args.host, port=args.port,
                    log_level="warning", timeout_graceful_shutdown=5,
                    timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        engine.shutdown()
    exit_now(0)  # uvicorn stopped and nothing is written: skip the interpreter's teardown


if __name__ == "__main__":
    main()
