"""A CPU inference server wrapping transformers, speaking SGLang's native HTTP API.

It mirrors the protocol of SGLang sglang_api.HF_PROTOCOL (the newest supported release): the
routes and JSON shapes of its entrypoints/http_server.py and managers/io_struct.py, the
weight-update session, the pause modes' treatment of the running batch and the version spans
of its results, so a rollout worker or trainer cannot tell this server from `python -m
sglang.launch_server`. Here: the engine (model, queue, generation thread, pauses); its state
in one object, state.py, reported by `HFEngine.status()`; the weight updates (session, group,
shared tensors, adapters, label) are a mixin from weights.py; the routes are in server.py,
the command line in __main__.py, request parsing in parsing.py, per-row sampling in batch.py,
the teacher-forced forward and media tensors in forward.py.

Prefill log-probs (how a teacher scores a student's response): `return_logprob=true` with
`logprob_start_len=k >= 0` adds `meta_info.input_token_logprobs`, one `[logprob, token_id, None]`
per input position from k on, the first input token's log-prob being None, at temperature 1,
as SGLang does; with `max_new_tokens=0` nothing is generated and only the prefill runs.

Multimodal models (Qwen2.5-VL, Qwen3-VL, Qwen2-Audio, ...: `relax_slurm.modeling`): `image_data`
/ `video_data` / `audio_data` as SGLang takes them (one list of items per input; an item is a
file name, a data URL or base64 bytes; a video also a folder of frames) are processed with the
model's own image processor / feature extractor (`relax_slurm.data.processor`, the code the
rollout worker runs too); each item's pad token in `input_ids` is expanded to its token count
(ids already expanded pass unchanged) and the tensors ride along with the row into the batched
`generate`.

Routed experts (MoE models, started with --enable-return-routed-experts, as SGLang):
`return_routed_experts=true` adds `meta_info.routed_experts`, base64 of int32 expert ids
[prompt + completion - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]
recorded by hooks on the routers during the batch's generate (`relax_slurm.routing`). Without
the flag the field is absent, as it is from SGLang.

Dynamic batching: requests queue up; one generation thread takes up to --max-batch-size
sequences (waiting up to --batch-wait-ms for more) and runs one `model.generate` with left
padding. Per-row sampling params, stop conditions and log-probs are handled by a logits
processor and a stopping criterion that share one `BatchState`.

The command line: __main__.py (`python -m relax_slurm.engines.hf`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Optional

import torch
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from relax_slurm.data.processor import MediaLimits, MediaProcessor
from relax_slurm.modeling import (auto_model_class, is_multimodal, media_token_ids,
                                  text_model, text_only_kwargs)
from relax_slurm.engines.hf.adapters import Adapters
from relax_slurm.engines.hf.batch import BatchState, PendingRequest, Row, RowSampler, RowStopper
from relax_slurm.engines.hf.forward import input_logprobs, mm_kwargs
from relax_slurm.engines.hf.parsing import BadRequest, NotServing, SamplingSpec
from relax_slurm.engines.hf.state import PARTIAL_WEIGHTS, EngineState
from relax_slurm.engines.hf.weights import WeightUpdates
from relax_slurm.routing.hooks import RoutingTrace
from relax_slurm.routing.shape import encode_routed_experts, routing_shape_of
from relax_slurm.weightsync.receiver import WeightReceiver

log = logging.getLogger("relax_slurm.hf_engine")

PREFILL_ONLY = {"type": "length", "length": 0}
"""The finish reason of a row that generates nothing (max_new_tokens=0)."""
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
"""SGLang's finish reasons of an aborted running and waiting request."""


class HFEngine(WeightUpdates):
    """The model, the request queue and the generation thread."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str], dtype: str, device: str,
                 max_batch_size: int, batch_wait_ms: float, weight_version: str,
                 sync_timeout_s: float, media_limits: Optional[MediaLimits] = None,
                 return_routed_experts: bool = False, enable_lora: bool = False) -> None:
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        # the whole model holds the weights under the names a sync sends (Qwen3-Omni:
        # `thinker.*`, its talker and code2wav not built: text_only_kwargs); `self.lm` is
        # what generates the tokens (Qwen3-Omni's thinker, as SGLang serves it; else the model)
        self.model = auto_model_class(model_path).from_pretrained(
            model_path, dtype=getattr(torch, dtype), **text_only_kwargs(model_path)
        ).to(self.device).eval()
        self.lm = text_model(self.model)
        self.media = (MediaProcessor(model_path, self.tokenizer.get_vocab(), media_limits)
                      if is_multimodal(model_path) else None)
        self.banned_ids = media_token_ids(self.model.config)
        self.vocab_size = int(self.lm.get_output_embeddings().weight.shape[0])
        self.routing = routing_shape_of(self.model.config.to_dict()) if return_routed_experts \
            else None
        if return_routed_experts and self.routing is None:
            raise ValueError(f"--enable-return-routed-experts: {model_path} is not a "
                             "mixture-of-experts model (its config has no num_experts)")
        self.adapters = Adapters(self.model, enable_lora)  # --enable-lora (adapters.py)
        self.eos_ids = self._eos_ids()
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, *sorted(self.eos_ids), 0)
                           if i is not None)
        # The model's own generation_config (top_k=20, temperature=0.6, eos ids, ...) would be
        # merged into every call; per-row sampling is ours, so make the defaults neutral.
        self.lm.generation_config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=self.pad_id,
            eos_token_id=None, bos_token_id=None)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.weight_version = str(weight_version)
        self.receiver = WeightReceiver(sync_timeout_s)
        self.sync_timeout_s = sync_timeout_s
        self.stats = {"num_batches": 0, "num_sequences": 0, "max_batch_seen": 0}
        # response ids as SGLang's (32 hex digits, unique): one random prefix per engine and a
        # counter, not a uuid4 per response (an os.urandom each, 512 a tiny step)
        self._id_prefix, self._id_count = uuid.uuid4().hex[:16], itertools.count()
        self.state = EngineState()  # changed under _cond (partial_weights: under _model_lock)
        self._cond = threading.Condition()
        self._stop = False
        self._model_lock = threading.Lock()  # held by a generate call or a weight update
        self._thread = threading.Thread(target=self._loop, name="hf-generate", daemon=True)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        config = self.lm.config  # Qwen3-Omni: the thinker's
        text_config = getattr(config, "text_config", None)  # multimodal models keep it there
        for src in (self.tokenizer.eos_token_id, getattr(config, "eos_token_id", None),
                    getattr(text_config, "eos_token_id", None),
                    getattr(self.lm.generation_config, "eos_token_id", None)):
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

    def submit(self, prompts: list[list[int]], specs: list[SamplingSpec],
               logprob_flags: list[bool], logprob_start_lens: Optional[list[int]] = None,
               mm: Optional[list[Optional[dict]]] = None,
               routed_start: Optional[int] = None, lora_path: Optional[str] = None,
               token_ids: Optional[list[Optional[list[int]]]] = None) -> Future:
        """Queue one request's sequences; the future resolves to their response items.
        `routed_start`: return routed experts from this position on (ignored, as by SGLang,
        unless the engine was started with them enabled). `lora_path`: the adapter they run
        with (adapters.py), None: the base weights."""
        self.adapters.check_request(lora_path)
        req = PendingRequest(future=Future(), results=[None] * len(prompts), remaining=len(prompts))
        starts = logprob_start_lens or [-1] * len(prompts)
        mm = mm or [None] * len(prompts)
        routed_start = routed_start if self.routing is not None else None
        token_ids = token_ids or [None] * len(prompts)
        rows = [Row(ids, spec, lp, req, i, start, m, routed_start=routed_start,
                    lora_path=lora_path, token_ids_logprob=tids)
                for i, (ids, spec, lp, start, m, tids)
                in enumerate(zip(prompts, specs, logprob_flags, starts, mm, token_ids))]
        queued = []
        for row in rows:
            if row.spec.max_new_tokens == 0 and not row.wants_input_logprobs:  # nothing to run
                req.deliver(row.index, self._item(row, PREFILL_ONLY))
            else:
                queued.append(row)
        with self._cond:
            self.state.pending.extend(queued)
            self._cond.notify_all()
        return req.future

    def _next_batch(self) -> list[Row]:
        with self._cond:
            if not self.state.pending or self.state.paused:
                self._cond.wait(timeout=0.5)
                return []
            # dynamic batching: wait a little for more sequences to arrive
            deadline = time.monotonic() + self.batch_wait_s
            while (0 < len(self.state.pending) < self.max_batch_size
                   and not self.state.paused):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            # a pause, or an abort_all that emptied the queue while this waited (the wait
            # releases the lock): nothing to run (the thread died on the empty queue before)
            if self.state.paused or not self.state.pending:
                return []
            # one adapter (or none) per batch: the rows at the head that share the first's
            pending, rows = self.state.pending, []
            lora_path = pending[0].lora_path
            while pending and len(rows) < self.max_batch_size \
                    and pending[0].lora_path == lora_path:
                rows.append(pending.popleft())
            self.state.busy = True
            return rows

    def _loop(self) -> None:
        while not self._stop:
            rows = self._next_batch()
            if not rows:
                continue
            try:
                self._run_batch(rows)
            finally:
                with self._cond:
                    self.state.busy = False
                    if not self.state.paused:  # an abort_all's interrupt ended with its batch
                        self.state.interrupt = None
                    self._cond.notify_all()

    def _interrupted(self) -> bool:
        return self.state.interrupt is not None

    def _run_batch(self, rows: list[Row]) -> None:
        with self._model_lock:  # a weight update waits for this batch to finish
            version = self.weight_version
            if self.state.partial_weights:  # queued while an update that then failed held the lock
                for row in rows:
                    row.request.fail(NotServing(PARTIAL_WEIGHTS))
                return
            try:
                self.adapters.serve(rows[0].lora_path)
                to_generate = [r for r in rows if r.spec.max_new_tokens > 0]
                finishes = dict(zip(map(id, to_generate), self._generate(to_generate, version)
                                    if to_generate else []))
                # once per row: a continued row computed them in its first batch
                input_logprobs(self.lm, self.device, self.pad_id,
                               [r for r in rows if r.wants_input_logprobs
                                and r.input_logprobs is None], self.max_batch_size)
            except Exception as e:  # a bad batch fails its requests, not the server
                log.exception("generate failed for a batch of %d", len(rows))
                for row in rows:
                    row.request.fail(e)
                return
            mode = self.state.interrupt
        stopped = []
        for row in rows:
            finish = finishes.get(id(row), PREFILL_ONLY)
            if finish is None and mode is None:  # generate() ended the row without a reason
                finish = {"type": "length", "length": len(row.out_ids)}
            if finish is None:
                stopped.append(row)
            else:
                row.request.deliver(row.index, self._item(row, finish, version))
        if stopped:
            self._stop_rows(stopped, mode)

    def _stop_rows(self, rows: list[Row], mode: str) -> None:
        """Rows a pause interrupted midway, as SGLang treats its running batch: abort ends them
        with what they have; retract puts them back at the head of the queue, to continue from
        prompt + tokens so far once generation continues (on the weights then served, recorded
        in their version spans); in_place does the same, but until then they count as running
        (a cache flush is refused). SGLang keeps in-place rows' KV cache; here it is recomputed."""
        if mode == "abort":
            for row in rows:
                row.request.deliver(row.index, self._item(row, ABORTED))
            return
        with self._cond:
            for row in reversed(rows):
                row.held_in_place = mode == "in_place"
                row.retractions += 1
                self.state.pending.appendleft(row)
            self._cond.notify_all()

    @torch.no_grad()
    def _generate(self, rows: list[Row], version: str) -> list[Optional[dict]]:
        """One generate call for `rows` (each from its prompt + tokens so far) on the weights
        `version`; each row's finish reason, None for a row a pause stopped midway."""
        inputs = [r.input_ids + r.out_ids for r in rows]
        before = [len(r.out_ids) for r in rows]
        batch, width = len(rows), max(len(ids) for ids in inputs)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, L] left-padded
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, ids in enumerate(inputs):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        batch_state = BatchState(rows, self.eos_ids, self.tokenizer, self.device)
        input_ids = input_ids.to(self.device)
        trace = RoutingTrace(batch) if any(r.routed_start is not None for r in rows) else None
        self.state.running = rows
        try:
            with trace.record(self.lm) if trace else contextlib.nullcontext():
                self.lm.generate(
                    input_ids=input_ids, attention_mask=attention_mask.to(self.device),
                    **mm_kwargs(self.lm, self.device, rows, input_ids),
                    max_new_tokens=max(r.spec.max_new_tokens - n for r, n in zip(rows, before)),
                    logits_processor=LogitsProcessorList([RowSampler(batch_state,
                                                                     self.banned_ids)]),
                    stopping_criteria=StoppingCriteriaList([RowStopper(batch_state,
                                                                       self._interrupted)]))
        finally:
            self.state.running = []
        self.stats["num_batches"] += 1
        self.stats["num_sequences"] += batch
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], batch)
        for row, n in zip(rows, before):
            row.add_tokens(version, n)
        if trace is not None:
            # every position that went through a forward: the inputs, and each new token but
            # the last (SGLang's [0, seqlen - 1)); left padding shifts row i by width - len
            lengths = [len(r.input_ids) + len(r.out_ids) - 1 for r in rows]
            pads = [width - len(ids) for ids in inputs]
            for row, ids in zip(rows, trace.rows(self.routing.layers, lengths, pads)):
                row.routed = ids
        return batch_state.finish

    def _item(self, row: Row, finish: dict, version: Optional[str] = None) -> dict:
        """One response element in SGLang's shape; `version`: the weights serving now."""
        spec, out_ids = row.spec, row.out_ids
        version = version or self.weight_version
        text = self.tokenizer.decode(out_ids, skip_special_tokens=spec.skip_special_tokens)
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), str) \
                and not spec.no_stop_trim:
            text = text[:text.find(finish["matched"])]
        spans = row.weight_versions(version)
        meta: dict[str, Any] = {
            "id": f"{self._id_prefix}{next(self._id_count):016x}", "finish_reason": finish,
            "prompt_tokens": len(row.input_ids), "completion_tokens": len(out_ids),
            "cached_tokens": 0, "num_retractions": row.retractions,
            # the final result's version is its last span's, as SGLang reports it
            "weight_version": spans[-1]["version"], "weight_versions": spans,
        }
        if row.return_logprob:
            # SGLang: [logprob, token_id, token_text]; text is None unless return_text_in_logprobs
            meta["output_token_logprobs"] = [[lp, tok, None]
                                             for lp, tok in zip(row.logprobs, out_ids)]
        if row.routed_start is not None and row.routed is not None:
            meta["routed_experts"] = encode_routed_experts(row.routed[row.routed_start:].numpy())
        if row.input_logprobs is not None:
            tokens = row.input_ids[row.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tok, None]
                                            for lp, tok in zip(row.input_logprobs, tokens)]
            if row.input_token_ids_logprobs is not None:
                meta["input_token_ids_logprobs"] = row.input_token_ids_logprobs
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ---- control: pause, weights ------------------------------------------------------------

    def pause(self, mode: str) -> None:
        """SGLang's /pause_generation: start no new batch and stop the one in flight after its
        current token (its rows per `mode`, see _stop_rows); abort also ends the queued
        requests. Returns once no batch runs."""
        with self._cond:
            self.state.paused = True
            self.state.interrupt = mode
            aborted = list(self.state.pending) if mode == "abort" else []
            if aborted:
                self.state.pending.clear()
        self._abort_queued(aborted)
        self._wait_idle()

    def abort_all(self) -> None:
        """/abort_request with abort_all: every request ends with finish_reason abort (the
        batch in flight after its current token)."""
        with self._cond:
            aborted = list(self.state.pending)
            self.state.pending.clear()
            if self.state.busy:
                self.state.interrupt = "abort"
        self._abort_queued(aborted)

    def _abort_queued(self, rows: list[Row]) -> None:
        for row in rows:
            row.request.deliver(row.index, self._item(row, ABORTED_WAITING))

    def resume(self) -> None:
        """/continue_generation: retracted and in-place rows continue first, on the weights
        served now."""
        with self._cond:
            self.state.paused = False
            self.state.interrupt = None
            for row in self.state.pending:
                row.held_in_place = False
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        """What /server_info reports of the engine's state."""
        with self._cond:
            return {**self.state.status(), "weight_update_groups": self.receiver.group_names()}

    def check_serving(self) -> None:
        """Refuse a /generate now (memory released: 400; weights left partial: 503)."""
        with self._cond:
            self.state.check_serving()

    def held_in_place(self) -> bool:
        """Requests paused in place (SGLang: still in the running batch)."""
        with self._cond:
            return self.state.held_in_place()

    def release_memory(self, tags: list[str]) -> None:
        """/release_memory_occupation: refused while generating, as SGLang asserts an idle
        engine there (and its scheduler dies)."""
        with self._cond:
            if not self.state.idle_or_paused():
                raise BadRequest("the engine is generating: pause it first (/pause_generation "
                                 "with mode retract or abort), SGLang asserts an idle engine "
                                 "here")
            self.state.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        """/resume_memory_occupation; a paused engine stays paused, as SGLang's."""
        with self._cond:
            self.state.released -= set(tags)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.sync_timeout_s
        with self._cond:
            while self.state.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the batch in flight did not finish within "
                                       f"{self.sync_timeout_s}s")
                self._cond.wait(timeout=left)
