"""A CPU inference server wrapping transformers, speaking SGLang's native HTTP API.

It mirrors the protocol of SGLang sglang_api.HF_PROTOCOL (the newest supported release): the
routes and JSON shapes of its entrypoints/http_server.py and managers/io_struct.py, the
weight-update session, the pause modes' treatment of the running batch and the version spans
of its results, so a rollout worker or trainer cannot tell this server from `python -m
sglang.launch_server`. Here: the engine (model, queue, generation thread, pause and weight
control); the routes and CLI are in hf_server.py, request parsing in hf_requests.py, per-row
sampling in hf_batch.py.

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

  python -m relax_slurm.rollout.hf_engine --model-path P --host H --port N --dtype float32 \
      --max-batch-size 1024 --batch-wait-ms 5 --torch-threads 1 --seed S --weight-version 0
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from typing import Any, Optional

import torch
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from relax_slurm.data.processor import MediaLimits, MediaProcessor, concat_tensors
from relax_slurm.errors import WeightSyncError
from relax_slurm.modeling import (auto_model_class, is_multimodal, media_token_ids,
                                  mm_token_types)
from relax_slurm.engines import sglang_api
from relax_slurm.rollout.hf_batch import BatchState, PendingRequest, Row, RowSampler, RowStopper
from relax_slurm.rollout.hf_requests import BadRequest, NotServing, SamplingSpec
from relax_slurm.routing.hooks import RoutingTrace
from relax_slurm.routing.shape import encode_routed_experts, routing_shape_of
from relax_slurm.weightsync.receiver import (WeightReceiver, load_named_tensors, model_checksums,
                                            weight_targets)

log = logging.getLogger("relax_slurm.hf_engine")

# idle keep-alive connections live this long (uvicorn's 5 s default races with clients that
# reuse a connection after a pause between training steps)
KEEP_ALIVE_S = 120


PREFILL_ONLY = {"type": "length", "length": 0}
"""The finish reason of a row that generates nothing (max_new_tokens=0)."""
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
"""SGLang's finish reasons of an aborted running and waiting request."""

PARTIAL_WEIGHTS = ("the last weight update failed midway and left a mix of two versions: "
                   "generation resumes after the next complete /update_weights_from_distributed")


_KEEP_DTYPE = frozenset({"second_per_grid_ts"})  # media tensors not cast to the model's dtype


class HFEngine:
    """The model, the request queue and the generation thread."""

    def __init__(self, model_path: str, tokenizer_path: Optional[str], dtype: str, device: str,
                 max_batch_size: int, batch_wait_ms: float, weight_version: str,
                 sync_timeout_s: float, media_limits: Optional[MediaLimits] = None,
                 return_routed_experts: bool = False) -> None:
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
        self.routing = routing_shape_of(self.model.config.to_dict()) if return_routed_experts \
            else None
        if return_routed_experts and self.routing is None:
            raise ValueError(f"--enable-return-routed-experts: {model_path} is not a "
                             "mixture-of-experts model (its config has no num_experts)")
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
        self._pending: deque[Row] = deque()
        self._cond = threading.Condition()
        self._paused = False
        self._interrupt: Optional[str] = None
        """A pause's mode (or an abort_all's "abort") the batch in flight obeys: it stops after
        its current token, and its unfinished rows are aborted or go back to the queue."""
        self._session = False  # a weight-update session is open (/begin_weight_update)
        self.partial_weights = False
        self.released: set[str] = set()
        """Memory regions let go by /release_memory_occupation (colocated placement); CPU
        frees nothing, but generation is refused until resumed, as SGLang cannot generate
        without its weights and KV cache."""
        self._busy = False  # a batch was taken from the queue and is not delivered yet
        self._running: list[Row] = []  # the rows of the generate call in flight
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

    def submit(self, prompts: list[list[int]], specs: list[SamplingSpec],
               logprob_flags: list[bool], logprob_start_lens: Optional[list[int]] = None,
               mm: Optional[list[Optional[dict]]] = None,
               routed_start: Optional[int] = None) -> Future:
        """Queue one request's sequences; the future resolves to their response items.
        `routed_start`: return routed experts from this position on (ignored, as by SGLang,
        unless the engine was started with them enabled)."""
        req = PendingRequest(future=Future(), results=[None] * len(prompts), remaining=len(prompts))
        starts = logprob_start_lens or [-1] * len(prompts)
        mm = mm or [None] * len(prompts)
        routed_start = routed_start if self.routing is not None else None
        rows = [Row(ids, spec, lp, req, i, start, m, routed_start=routed_start)
                for i, (ids, spec, lp, start, m)
                in enumerate(zip(prompts, specs, logprob_flags, starts, mm))]
        queued = []
        for row in rows:
            if row.spec.max_new_tokens == 0 and not row.wants_input_logprobs:  # nothing to run
                req.deliver(row.index, self._item(row, PREFILL_ONLY))
            else:
                queued.append(row)
        with self._cond:
            self._pending.extend(queued)
            self._cond.notify_all()
        return req.future

    def _next_batch(self) -> list[Row]:
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
                    if not self._paused:  # an abort_all's interrupt ended with its batch
                        self._interrupt = None
                    self._cond.notify_all()

    def _interrupted(self) -> bool:
        return self._interrupt is not None

    def _run_batch(self, rows: list[Row]) -> None:
        with self._model_lock:  # a weight update waits for this batch to finish
            version = self.weight_version
            if self.partial_weights:  # queued while an update that then failed held the lock
                for row in rows:
                    row.request.fail(NotServing(PARTIAL_WEIGHTS))
                return
            try:
                to_generate = [r for r in rows if r.spec.max_new_tokens > 0]
                finishes = dict(zip(map(id, to_generate), self._generate(to_generate, version)
                                    if to_generate else []))
                # once per row: a continued row computed them in its first batch
                self._input_logprobs([r for r in rows if r.wants_input_logprobs
                                      and r.input_logprobs is None])
            except Exception as e:  # a bad batch fails its requests, not the server
                log.exception("generate failed for a batch of %d", len(rows))
                for row in rows:
                    row.request.fail(e)
                return
            mode = self._interrupt
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
                self._pending.appendleft(row)
            self._cond.notify_all()

    def _input_logprobs(self, rows: list[Row]) -> None:
        """Each row's `input_logprobs`: log-probs of its input tokens from logprob_start_len on,
        the first input token's being None; one teacher-forced forward per chunk of rows. At
        temperature 1 whatever the request's temperature, as SGLang computes them (its prefill
        path reads no sampling params): a teacher scores the same on both engines."""
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
                scores = logits[i, :n - 1].float()  # [L-1, V]
                targets = input_ids[i, 1:n][:, None]
                lps = (scores.gather(1, targets).squeeze(1) - torch.logsumexp(scores, -1))
                row.input_logprobs = [None, *lps.tolist()][row.logprob_start_len:]

    def _mm_kwargs(self, rows: list[Row], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
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
        state = BatchState(rows, self.eos_ids, self.tokenizer, self.device)
        input_ids = input_ids.to(self.device)
        trace = RoutingTrace(batch) if any(r.routed_start is not None for r in rows) else None
        self._running = rows
        try:
            with trace.record(self.model) if trace else contextlib.nullcontext():
                self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask.to(self.device),
                **self._mm_kwargs(rows, input_ids),
                    max_new_tokens=max(r.spec.max_new_tokens - n for r, n in zip(rows, before)),
                    logits_processor=LogitsProcessorList([RowSampler(state, self.banned_ids)]),
                    stopping_criteria=StoppingCriteriaList([RowStopper(state,
                                                                       self._interrupted)]))
        finally:
            self._running = []
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
        return state.finish

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
            "id": uuid.uuid4().hex, "finish_reason": finish,
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
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ---- control: pause, weights ------------------------------------------------------------

    def pause(self, mode: str) -> None:
        """SGLang's /pause_generation: start no new batch and stop the one in flight after its
        current token (its rows per `mode`, see _stop_rows); abort also ends the queued
        requests. Returns once no batch runs."""
        with self._cond:
            self._paused = True
            self._interrupt = mode
            aborted = list(self._pending) if mode == "abort" else []
            if aborted:
                self._pending.clear()
        self._abort_queued(aborted)
        self._wait_idle()

    def abort_all(self) -> None:
        """/abort_request with abort_all: every request ends with finish_reason abort (the
        batch in flight after its current token)."""
        with self._cond:
            aborted = list(self._pending)
            self._pending.clear()
            if self._busy:
                self._interrupt = "abort"
        self._abort_queued(aborted)

    def _abort_queued(self, rows: list[Row]) -> None:
        for row in rows:
            row.request.deliver(row.index, self._item(row, ABORTED_WAITING))

    def resume(self) -> None:
        """/continue_generation: retracted and in-place rows continue first, on the weights
        served now."""
        with self._cond:
            self._paused = False
            self._interrupt = None
            for row in self._pending:
                row.held_in_place = False
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        """What /server_info reports of the engine's state."""
        with self._cond:
            return {"paused": self._paused, "pause_mode": self._interrupt if self._paused else None,
                    "queued_sequences": len(self._pending),
                    "running_sequences": len(self._running),
                    "running_tokens": sum(len(r.out_ids) for r in self._running),
                    "held_in_place": sum(r.held_in_place for r in self._pending),
                    "weight_update_session": self._session,
                    "weight_update_groups": self.receiver.group_names(),
                    "memory_released": sorted(self.released)}

    def held_in_place(self) -> bool:
        """Requests paused in place (SGLang: still in the running batch)."""
        with self._cond:
            return any(r.held_in_place for r in self._pending)

    def idle_or_paused(self) -> bool:
        """What SGLang asserts before releasing memory: nothing running (a paused engine's
        queue does not count, its in-place batch does)."""
        with self._cond:
            if self._paused:
                return not any(r.held_in_place for r in self._pending)
            return not self._busy and not self._pending

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.sync_timeout_s
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the batch in flight did not finish within "
                                       f"{self.sync_timeout_s}s")
                self._cond.wait(timeout=left)

    def begin_session(self) -> None:
        """/begin_weight_update: updates are refused outside a session, as in SGLang 0.5.21+
        (which has no owner or timeout for one either)."""
        with self._cond:
            if self._session:
                raise BadRequest("a weight-update session is already open; call "
                                 "end_weight_update() first")
            self._session = True

    def end_session(self) -> None:
        with self._cond:
            if not self._session:
                raise BadRequest("no weight-update session is open; call "
                                 "begin_weight_update() first")
            self._session = False

    def update_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       group_name: str, weight_version: Optional[str], flush_cache: bool,
                       flattened: bool = False) -> None:
        """Receive (per-tensor broadcast from rank 0, in the order of names; or one of the
        flattened bucket) and load. As SGLang 0.5.22+: refused outside a session (before
        anything is received), and a flush with requests paused in place fails after the
        weights are loaded."""
        with self._cond:
            if not self._session:
                raise BadRequest(sglang_api.OUT_OF_SESSION)
        if not self.receiver.has_group(group_name):
            raise BadRequest(f"no weight-update group {group_name!r}: call "
                             "/init_weights_update_group")
        t0 = time.monotonic()
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"generation held the model for more than {self.sync_timeout_s}s")
        t_lock = t_received = time.monotonic()
        try:
            # received in place into the parameters: a failure midway leaves a mix of two
            # versions, so the engine serves nothing until a later update completes (requests
            # queued meanwhile are refused by _run_batch; the lock keeps them out until then)
            params = weight_targets(self.model)  # per-expert names too: views of fused experts
            try:
                received = self.receiver.receive(names, dtypes, shapes, group_name, self.device,
                                                 into=params, flattened=flattened)
                t_received = time.monotonic()
                load_named_tensors(self.model, received, adopt=flattened)
            except BaseException:
                self.partial_weights = True
                raise
            self.partial_weights = False
            if weight_version is not None:
                self.weight_version = str(weight_version)
        finally:
            self._model_lock.release()
        t_end = time.monotonic()
        # the phases are what docs/benchmarks.md's weight-sync profile reads from this line
        log.info("loaded %d tensors from group %r (weight_version %s) in %.4fs: lock %.4fs, "
                 "receive %.4fs, load %.4fs", len(names), group_name, self.weight_version,
                 t_end - t0, t_lock - t0, t_received - t_lock, t_end - t_received)
        if flush_cache and self.held_in_place():
            raise BadRequest(sglang_api.FLUSH_REFUSED)

    def destroy_group(self, group_name: str) -> bool:
        """/destroy_weights_update_group, once no update holds the model (one the trainer gave
        up midway drops out within a second of its next cohort forming)."""
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"an update held the model for more than {self.sync_timeout_s}s")
        try:
            return self.receiver.destroy_group(group_name)
        finally:
            self._model_lock.release()

    def checksums(self) -> dict[str, str]:
        with self._model_lock:
            return model_checksums(self.model)


if __name__ == "__main__":  # the entry point is the server's (hf_server.main)
    from relax_slurm.rollout.hf_server import main

    main()
