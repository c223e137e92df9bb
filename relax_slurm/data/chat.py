"""Turn a dataset's prompt cell into chat messages, then into the text and ids the engine gets.

A prompt cell is either a string (one user message) or a list of chat messages
(`{"role": ..., "content": ...}`, as in dapo-math-17k). `data.system_prompt` is prepended as a
system message unless the row already starts with one. With `data.apply_chat_template` the
tokenizer's template renders the messages with the generation prompt; without it the message
contents are joined with newlines and tokenized as plain text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, str]

RAW_TEXT_SEPARATOR = "\n"
"""Joins message contents when `data.apply_chat_template=false`."""


def to_messages(value: Any, system_prompt: str | None = None) -> list[Message]:
    """The chat messages of one prompt cell.

    Raises `TypeError` (with what was expected) when `value` is neither a string nor a list of
    role/content dicts; the dataset reader adds file, row and key to it.

    >>> to_messages("3+4=", system_prompt="Answer with one digit.")
    [{'role': 'system', 'content': 'Answer with one digit.'}, {'role': 'user', 'content': '3+4='}]
    """
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        messages = [_check_message(m, i) for i, m in enumerate(value)]
        if not messages:
            raise TypeError("got an empty list of messages")
    else:
        raise TypeError(
            f"expected a string or a list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__}"
        )
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _check_message(m: Any, i: int) -> Message:
    if not isinstance(m, Mapping):
        raise TypeError(f"message {i} is a {type(m).__name__}, expected a dict with role/content")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise TypeError(
            f"message {i} needs string 'role' and 'content', got role={role!r}, "
            f"content of type {type(content).__name__}"
        )
    return {"role": role, "content": content}


def _as_ids(out: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` returns a list in transformers 4 and, by default, a
    BatchEncoding in 5; accept both (and a dict), for one conversation."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor or array
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], list):  # a batch of one
        assert len(out) == 1, f"expected one conversation, got {len(out)}"
        out = out[0]
    return [int(t) for t in out]


def render(tokenizer: Any, messages: list[Message], apply_chat_template: bool,
           tools: list[dict] | None = None) -> str:
    """The prompt text the model sees (the chat template's output, or the joined contents).
    `tools` (OpenAI function schemas) go to the template's tools section."""
    if apply_chat_template:
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **extra)
    return RAW_TEXT_SEPARATOR.join(m["content"] for m in messages)


def encode(
    tokenizer: Any, messages: list[Message], apply_chat_template: bool
) -> tuple[str, list[int]]:
    """(rendered text, token ids) of one prompt.

    The chat template path tokenizes the way the tokenizer's owner intended (special tokens in
    the template, none added); raw text is tokenized with the tokenizer's defaults (a BOS token
    if it adds one).
    """
    text = render(tokenizer, messages, apply_chat_template)
    if apply_chat_template:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer(text)["input_ids"]
    return text, _as_ids(ids)


def encode_batch(
    tokenizer: Any, conversations: list[list[Message]], apply_chat_template: bool
) -> tuple[list[str], list[list[int]]]:
    """`encode` for many prompts: same texts and ids, one tokenizer call (much faster).

    With the chat template this renders each conversation once and tokenizes the texts without
    adding special tokens, which is what `apply_chat_template(tokenize=True)` does inside.
    """
    texts = [render(tokenizer, m, apply_chat_template) for m in conversations]
    if not texts:
        return [], []
    if apply_chat_template:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(texts)["input_ids"]
    return texts, [[int(t) for t in row] for row in ids]
