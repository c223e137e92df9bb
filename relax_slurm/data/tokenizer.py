"""Tokenizer loading for processes that never run a tensor op (rollout worker, evaluator).

`AutoTokenizer` imports torch (through transformers' configuration utilities) only to find the
class named in `tokenizer_config.json`; that is ~8 CPU-seconds per process here, paid again by
every restart. When the directory names a class that transformers exports, that class is loaded
directly: the same object `AutoTokenizer` returns, without torch. Anything else (no
tokenizer_config.json, no class named, remote code) goes through `AutoTokenizer` unchanged.
"""

from __future__ import annotations

import json
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
