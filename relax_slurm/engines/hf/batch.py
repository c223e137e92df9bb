"""One hf-engine generate call's rows: the HTTP request each row answers, the per-row sampling
(temperature, top-k/p, min-p, seeds) and stopping that let sequences of different requests share
one `model.generate`."""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from transformers import LogitsProcessor, StoppingCriteria

from relax_slurm.engines.hf.parsing import GREEDY_EPS, SamplingSpec
from relax_slurm.engines.seeds import generator_seed


@dataclass
class PendingRequest:
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
class Row:
    input_ids: list[int]
    spec: SamplingSpec
    return_logprob: bool
    request: PendingRequest
    index: int
    logprob_start_len: int = -1
    """>= 0: also return the log-probs of the input tokens from this position on."""
    mm: Optional[dict] = None
    """Processed media of this row (forward kwargs as numpy arrays), or None for text."""
    out_ids: list[int] = field(default_factory=list)
    """Tokens generated so far, over every batch the row ran in: a row retracted by a pause
    (SGLang's retract and in_place modes) keeps them and continues from prompt + out_ids."""
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)
    """[version, start, end] of out_ids, end exclusive (SGLang's meta_info.weight_versions)."""
    generator: Optional[torch.Generator] = None
    """A seeded row's own generator, kept across batches: a continued row draws on where it
    stopped, so its tokens are those of an uninterrupted run with the same weights."""
    held_in_place: bool = False
    """Interrupted by a pause in in_place mode: "running" as far as a cache flush goes."""
    retractions: int = 0
    input_logprobs: Optional[list] = None
    """Computed once, in the row's first batch (wants_input_logprobs)."""
    token_ids_logprob: Optional[list[int]] = None
    """Ids whose log-probs each input position also returns (SGLang's token_ids_logprob)."""
    input_token_ids_logprobs: Optional[list] = None
    """With input_logprobs: per position from logprob_start_len, [[logprob, id, None], ...]
    of token_ids_logprob (None for the very first input token)."""
    routed_start: Optional[int] = None
    """>= 0: return the experts each token was routed to from this position on (MoE models,
    SGLang's return_routed_experts / routed_experts_start_len)."""
    lora_path: Optional[str] = None
    """The adapter this row runs with (SGLang's lora_path), None: the base weights."""
    routed: Optional[torch.Tensor] = None
    """[prompt + out_ids - 1, layers, K] int32, from the row's last batch (a continued row's
    prefill recomputes every earlier position on the weights then served, as SGLang's does)."""

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def add_tokens(self, version: str, before: int) -> None:
        """Record that out_ids[before:] came from weights `version`."""
        end = len(self.out_ids)
        if end == before:
            return
        if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == before:
            self.spans[-1][2] = end
        else:
            self.spans.append([version, before, end])

    def weight_versions(self, version: str) -> list[dict]:
        """meta_info.weight_versions: the spans, or one empty span of `version` (the weights
        serving at the end) when nothing was generated, as SGLang reports it."""
        spans = self.spans or [[version, 0, 0]]
        return [{"version": v, "start": a, "end": b} for v, a, b in spans]


class BatchState:
    """Per-row outputs of one generate call, filled step by step."""

    def __init__(self, rows: list[Row], eos_ids: set[int], tokenizer: Any,
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
        # the rows' own lists: a continued row appends to what it generated before
        self.out_ids: list[list[int]] = [r.out_ids for r in rows]
        self.logprobs: list[list[float]] = [r.logprobs for r in rows]
        self.finish: list[Optional[dict]] = [None for _ in rows]
        # seeded rows draw from their own generator, so their tokens do not depend on what else
        # is in the batch or on the engine's history (exact resume relies on this)
        for r in rows:
            if r.spec.sampling_seed is not None and r.generator is None:
                r.generator = torch.Generator(device=device).manual_seed(
                    generator_seed(r.spec.sampling_seed))
        self.generators = [r.generator for r in rows]
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


class RowSampler(LogitsProcessor):
    """Per-row temperature, top-k, top-p, min-p; records the log-probs SGLang would return."""

    def __init__(self, state: BatchState, banned_ids: tuple[int, ...] = ()) -> None:
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


class RowStopper(StoppingCriteria):
    """Called after each new token: record it and its log-prob, decide which rows are done.
    Once `interrupted()` (a pause came) every row stops after this token; the unfinished ones
    are then aborted, or continued later, by the pause's mode."""

    def __init__(self, state: BatchState, interrupted: Callable[[], bool] = lambda: False
                 ) -> None:
        self.state = state
        self.interrupted = interrupted

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
        if self.interrupted():
            return torch.ones(len(st.finish), dtype=torch.bool, device=input_ids.device)
        return torch.tensor([f is not None for f in st.finish], dtype=torch.bool,
                            device=input_ids.device)
