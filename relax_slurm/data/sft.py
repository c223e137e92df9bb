"""Supervised rows: (prompt, response) pairs or chat conversations, tokenized for the trainer.

A row becomes one `SFTExample`: `prompt_ids` (everything before the first trained token),
`response_ids` (the rest) and `loss_mask` over the response (1 on assistant tokens). Rendering
goes through the same chat code as the rollout's prompts (`relax_slurm.data.chat`), so a model
warm-started here sees at RL time exactly the prompt format it was taught:

- (prompt, response) rows (`data.prompt_key`, `sft.response_key`): the prompt is rendered as the
  rollout renders it (`data.system_prompt`, the chat template with the generation prompt); the
  response is what the template adds for an assistant turn holding it (its end-of-turn tokens
  included, e.g. "7<eos>"). With `data.apply_chat_template=false`: the joined prompt text, then
  the response text and the tokenizer's EOS token.
- chat rows (`sft.messages_key`): every assistant turn is trained; system, user and tool turns
  are context (mask 0). Turn i's tokens are the template's text of messages[:i+1] minus that of
  messages[:i] with the generation prompt, tokenized piece by piece, so each assistant turn
  starts where generation would start. A template that renders an earlier turn differently once
  later turns follow (some strip past reasoning) cannot be cut this way: refused by row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax_slurm.config.data import DataConfig
from relax_slurm.config.sft import SFTConfig
from relax_slurm.data.chat import RAW_TEXT_SEPARATOR, Message, to_messages
from relax_slurm.data.dataset import read_table, table_column
from relax_slurm.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class SFTExample:
    prompt_ids: np.ndarray
    """Context before the first trained token, [P] int64 (P >= 1)."""
    response_ids: np.ndarray
    """Everything after it, [R] int64."""
    loss_mask: np.ndarray
    """1.0 on the tokens trained (assistant turns), 0.0 on context inside the response, [R]."""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


def _template(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                         tokenize=False)


def conversation_pieces(tokenizer: Any, messages: list[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces in order; ValueError when the
    template does not render it as a sequence of growing prefixes."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = _template(tokenizer, messages[:i], True) if i else ""
            if not before.startswith(done):
                raise ValueError(f"the chat template renders the turns before message {i} "
                                 "differently once it follows them")
            pieces.append((before[len(done):], False))
            done = before
        after = _template(tokenizer, messages[:i + 1], False)
        if not after.startswith(done):
            raise ValueError(f"the chat template renders the turns before message {i} "
                             "differently once it follows them")
        pieces.append((after[len(done):], m["role"] == "assistant"))
        done = after
    return [(text, trained) for text, trained in pieces if text]


def encode_example(tokenizer: Any, messages: list[Message], apply_chat_template: bool
                   ) -> SFTExample:
    """One conversation (at least one assistant turn) as prompt, response and mask."""
    if apply_chat_template:
        pieces = conversation_pieces(tokenizer, messages)
    else:  # the rollout's raw-text prompt, then the answer and EOS (the model learns to stop)
        *context, answer = messages
        if answer["role"] != "assistant" or any(m["role"] == "assistant" for m in context):
            raise ValueError("without a chat template (data.apply_chat_template=false) a row is "
                             "one prompt and one final answer; multi-turn rows need the template")
        pieces = [(RAW_TEXT_SEPARATOR.join(m["content"] for m in context), False),
                  (answer["content"] + (tokenizer.eos_token or ""), True)]
    ids: list[int] = []
    mask: list[float] = []
    for text, trained in pieces:
        tokens = _ids(tokenizer, text)
        ids += tokens
        mask += [float(trained)] * len(tokens)
    if 1.0 not in mask:
        raise ValueError("no assistant tokens to train on")
    first = mask.index(1.0)
    if first == 0:
        raise ValueError("the first token is already trained: there is no context to predict it "
                         "from (give the row a prompt)")
    return SFTExample(prompt_ids=np.array(ids[:first], dtype=np.int64),
                      response_ids=np.array(ids[first:], dtype=np.int64),
                      loss_mask=np.array(mask[first:], dtype=np.float32))


def _row_messages(table: Any, path: Path, data: DataConfig, sft: SFTConfig) -> list[Any]:
    if sft.messages_key:
        return table_column(table, sft.messages_key, "sft.messages_key", path)
    prompts = table_column(table, data.prompt_key, "data.prompt_key", path)
    responses = table_column(table, sft.response_key, "sft.response_key", path)
    out = []
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        if prompt is None or response is None:
            key = sft.response_key if prompt is not None else data.prompt_key
            raise DataError(f"{path}, row {row}, key {key!r}: missing. Fix: fill it in")
        if not isinstance(response, str):
            response = str(response)  # a jsonl label such as 7 reads back as a number
        out.append((prompt, response))
    return out


def read_examples(files: list[str], data: DataConfig, sft: SFTConfig, tokenizer: Any
                  ) -> list[SFTExample]:
    """Every row of `files` within `sft.max_tokens` (longer rows dropped and counted)."""
    out: list[SFTExample] = []
    dropped = 0
    for path in files:
        table = read_table(path)
        for row, cell in enumerate(_row_messages(table, Path(path), data, sft)):
            where = f"{path}, row {row}"
            try:
                if sft.messages_key:
                    messages = to_messages(cell, data.system_prompt)
                else:
                    messages = [*to_messages(cell[0], data.system_prompt),
                                {"role": "assistant", "content": cell[1]}]
                example = encode_example(tokenizer, messages, data.apply_chat_template)
            except (TypeError, ValueError) as e:
                key = sft.messages_key or data.prompt_key
                raise DataError(f"{where}, key {key!r}: {e}. Fix the row, or set "
                                "sft.messages_key / data.prompt_key / sft.response_key to the "
                                "right columns") from e
            if len(example.prompt_ids) + len(example.response_ids) > sft.max_tokens:
                dropped += 1
                continue
            out.append(example)
    if dropped:
        log.warning("dropped %d rows longer than sft.max_tokens=%d", dropped, sft.max_tokens)
    if not out:
        raise DataError(f"{', '.join(map(str, files))}: no row to train on ({dropped} longer than "
                        f"sft.max_tokens={sft.max_tokens}). Fix: point the files at rows, or "
                        "raise sft.max_tokens")
    return out


class EpochSampler:
    """Row indices, epoch after epoch: each epoch a permutation drawn with `seed + epoch`
    (file order without `shuffle`); batches run on across epoch ends. Resumable."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._draw()

    def _draw(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.num_rows)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.index == self.num_rows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._draw()
            out.append(int(self._order[self.index]))
            self.index += 1
        return out

    @property
    def epochs_done(self) -> float:
        """Passes over the data so far (fractional)."""
        return self.epoch + self.index / self.num_rows

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": self.num_rows}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["num_rows"] != self.num_rows:
            raise DataError(f"the checkpoint's SFT data had {state['num_rows']} rows, this one has "
                            f"{self.num_rows}: data.train_files or sft.max_tokens changed since. "
                            "Fix: resume with the same data, or start a new run_dir")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._draw()
