"""Tokenizer loading for processes that never run a tensor op (rollout worker, evaluator).

`AutoTokenizer` imports torch (through transformers' configuration utilities) only to find the
class named in `tokenizer_config.json`; that is ~8 CPU-seconds per process here, paid again by
every restart. When the directory names a class that transformers exports, that class is loaded
directly: the same object `AutoTokenizer` returns, without torch. Anything else (no
tokenizer_config.json, no class named, remote code) goes through `AutoTokenizer` unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def tokenizer_class_name(path: str | Path) -> str | None:
    """The `tokenizer_class` a local HF directory names, or None (hub ids, remote code)."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    if "auto_map" in data:  # a custom class: only AutoTokenizer knows how to load it
        return None
    return data.get("tokenizer_class")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    import transformers

    name = tokenizer_class_name(path)
    cls = getattr(transformers, name, None) if name and not trust_remote_code else None
    if cls is not None:
        return cls.from_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path),
                                                      trust_remote_code=trust_remote_code)


# the `_decode`s that only call the tokenizers library and then, if asked, clean up spaces
_LIBRARY_DECODES = frozenset({"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"})


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of one token list, taken
    straight from the tokenizers library when that is all transformers would do with it: a fast
    tokenizer whose `decode` and `_decode` are transformers' own and that cleans up no spaces.
    The wrapper's ~2 us an answer (converting the list, the keywords) were 1.2 ms of a tiny
    step's 512 rewards, against 0.2 ms for the library's own decode. Any other tokenizer, and
    ids the library does not take (numpy integers), go through `tokenizer.decode`."""
    def wrapped(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    cls, library = type(tokenizer), getattr(tokenizer, "backend_tokenizer", None)
    if (library is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or getattr(cls, "_decode", None) is None
            or cls._decode.__qualname__ not in _LIBRARY_DECODES
            or cls.decode.__qualname__ != "PreTrainedTokenizerBase.decode"):
        return wrapped

    def direct(ids: list[int]) -> str:
        try:
            return library.decode(ids, skip_special_tokens=True)
        except TypeError:
            return wrapped(ids)
    return direct
