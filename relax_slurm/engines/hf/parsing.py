"""The hf engine's side of SGLang's /generate request: sampling params and inputs, parsed and
checked (SGLang's names and defaults; anything the hf engine cannot honour is refused with 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from relax_slurm.data.media import MODALITIES, MediaRef, from_engine
from relax_slurm.data.processor import MediaProcessor
from relax_slurm.errors import DataError

GREEDY_EPS = 1e-6
"""SGLang samples greedily (top_k=1) when temperature < 1e-6; so do we."""


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
_KNOWN = frozenset(SamplingSpec.__dataclass_fields__) | frozenset(_DEFAULT_ONLY) | _TEXT_ONLY


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
    params = params or {}
    # (set operations: this runs for each of a batch's sequences, 512 a tiny step)
    unknown = params.keys() - _KNOWN
    if unknown:
        raise BadRequest(f"unknown sampling param {sorted(unknown)[0]!r}")
    for key in params.keys() & _DEFAULT_ONLY.keys():
        default = _DEFAULT_ONLY[key]
        if params[key] is not None and params[key] != default:
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
    for key in ("top_logprobs_num", "return_hidden_states", "input_embeds"):
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


def parse_token_ids_logprob(body: dict, n: int, vocab_size: int) -> list[Optional[list[int]]]:
    """SGLang's `token_ids_logprob`: ids whose log-probs every position also returns (one list
    for all inputs, or one per input). The hf engine returns them for the input positions
    (meta_info.input_token_ids_logprobs), not for the output ones."""
    value = body.get("token_ids_logprob")
    if not value:
        return [None] * n
    per_input = value if isinstance(value[0], list) else [value] * n
    if len(per_input) != n:
        raise BadRequest(f"token_ids_logprob: {len(per_input)} lists for {n} inputs")
    for ids in per_input:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                   for t in ids or []):
            raise BadRequest(f"token_ids_logprob={ids!r}: ids in the vocabulary [0, "
                             f"{vocab_size})")
    return [list(ids) if ids else None for ids in per_input]


def parse_lora_path(body: dict) -> Optional[str]:
    """SGLang's `lora_path`: the adapter a request runs with (one name, or one per input, here
    all the same); None: the base weights."""
    value = body.get("lora_path")
    if isinstance(value, list):
        names = set(value)
        if len(names) > 1:
            raise BadRequest(f"lora_path names {len(names)} adapters: the hf engine runs one "
                             "adapter per request")
        value = next(iter(names), None)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"lora_path={value!r}: an adapter's name")
    return value


def parse_routing_request(body: dict, prompts: list[list[int]]) -> Optional[int]:
    """SGLang's `return_routed_experts` (one flag for the request) and
    `routed_experts_start_len` (the first position returned, 0..prompt length): the start, or
    None when no routing is asked for."""
    if not body.get("return_routed_experts"):
        return None
    start = body.get("routed_experts_start_len", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 \
            or any(start > len(p) for p in prompts):
        raise BadRequest(f"routed_experts_start_len={start!r}: must be an int in 0..the number "
                         "of input tokens")
    return start


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


def process_media(processor: Optional[MediaProcessor], model_path: str, prompts: list[list[int]],
                  media: list[dict[str, list[MediaRef]]]
                  ) -> tuple[list[list[int]], list[Optional[dict]]]:
    """Each input's ids with its media pads expanded, and its processed tensors (None for
    text); inputs with the same ids and media (a group's samples) are processed once."""
    if not any(any(m.values()) for m in media):
        return prompts, [None] * len(prompts)
    if processor is None:
        raise BadRequest(f"image_data/video_data/audio_data sent, but {model_path} is "
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
                done[key] = processor.process(ids, items, where=f"input {i}")
            except DataError as e:
                raise BadRequest(str(e)) from e
        ids_out.append(done[key].input_ids)
        mm_out.append(done[key].tensors)
    return ids_out, mm_out
