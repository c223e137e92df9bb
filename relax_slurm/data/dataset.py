"""Prompt datasets: read jsonl / parquet / saved-dataset files, render and tokenize, iterate.

`PromptDataset(cfg.data, tokenizer)` reads every file of `data.train_files` (concatenated in
order), renders each row's prompt (see `relax_slurm.data.chat`), drops prompts longer than
`data.max_prompt_tokens` (counted in `num_filtered`) and then yields `Prompt`s, reshuffled every
epoch with `seed + epoch`, for `data.num_epochs` passes. `state_dict()` records the position so
a resumed run continues with exactly the next prompt.

Rows are tokenized up front, in one batched tokenizer call per file (5000 short prompts take
well under a second); the length filter and `len()` need the token counts anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_slurm.config.data import DataConfig
from relax_slurm.data.chat import encode_batch, to_messages
from relax_slurm.data.media import (MediaRef, add_placeholders, add_video_tracks, check_counts,
                                    check_image, replace_placeholders, row_media)
from relax_slurm.data.validate import json_rows
from relax_slurm.data.video import check_video
from relax_slurm.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ID_COLUMN = "id"
"""A row's own id is used as `prompt_id` when the file has this column; else `file:row`."""

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Prompt:
    """One prompt, ready for the engine and the reward."""

    prompt_id: str
    input_ids: list[int]
    """Token ids after the chat template, [P]."""
    text: str
    """The rendered prompt (what `input_ids` encode)."""
    label: Any
    """The reference answer (`data.label_key`), handed to the reward."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's `data.metadata_key` column, or empty."""
    media: dict[str, list[MediaRef]] = field(default_factory=dict)
    """Media items by kind (`data.multimodal_keys`), in placeholder order; `input_ids` holds
    one pad token per item until `MediaProcessor.process` expands it."""


@dataclass(frozen=True)
class Table:
    """A data file's columns: their names in the file's order and each one's values, row by
    row (None where a row lacks the key)."""

    column_names: list[str]
    read: Callable[[str], list[Any]]


def read_table(path: str | Path) -> Table:
    """One file or saved dataset folder as a `Table`; `DataError` if it cannot be. A .jsonl
    file is read with the json module, line by line (each row's values as written: no schema
    unified across rows); .json, .parquet and folders through `datasets`, which the rollout
    worker then imports (~1.5 CPU-s, paid by every start of a worker that reads none)."""
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"{p}: no such file or folder. Fix: set data.train_files=[...] to existing "
            ".jsonl/.parquet files or folders written by datasets' save_to_disk"
        )
    if p.is_dir():
        import datasets  # imported here: it is slow to import and only these readers need it

        ds = _load_from_disk(p, datasets)
        return _datasets_table(ds)
    builder = _BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise DataError(
            f"{p}: unknown file type {p.suffix!r}. Fix: use .jsonl, .json or .parquet files, "
            "or a folder written by datasets' save_to_disk"
        )
    if p.stat().st_size == 0:
        raise DataError(f"{p}: the file is empty. Fix: remove it from data.train_files")
    if p.suffix.lower() == ".jsonl":
        return _jsonl_table(p)
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as e:  # pyarrow, json and datasets errors all mean "cannot read it"
        where = _diagnose_jsonl(p) if builder == "json" else None
        raise DataError(
            f"{p}: cannot read it as {builder}"
            + (f": {where}" if where else f" ({type(e).__name__}: {e})")
            + ". Fix the file or remove it from data.train_files"
        ) from e
    return _datasets_table(ds)


def _datasets_table(ds) -> Table:
    """A `datasets.Dataset` as a `Table`: one slice formats a whole column at once (iterating
    a column goes row by row, slowly) and decodes datasets' Json columns (a key whose type
    varies between rows)."""
    return Table(list(ds.column_names), lambda key: ds.select_columns([key])[:][key])


def _jsonl_table(p: Path) -> Table:
    rows: list[dict[str, Any]] = []
    for line_no, row in json_rows(p):
        if not isinstance(row, dict):
            raise DataError(f"{p}:{line_no}: a JSON {type(row).__name__}, not an object. Fix: "
                            'one object per line, e.g. {"prompt": "1+1=", "label": "2"}')
        rows.append(row)
    names = list(dict.fromkeys(k for row in rows for k in row))  # first seen, first
    return Table(names, lambda key: [row.get(key) for row in rows])


def _load_from_disk(p: Path, datasets: Any) -> Any:
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(
            f"{p}: is a folder but not a saved dataset ({type(e).__name__}: {e}). Fix: point "
            "data.train_files at a folder written by Dataset.save_to_disk, or at the files in it"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise DataError(
            f"{p}: holds splits {sorted(ds)} and none is 'train'. Fix: point data.train_files "
            f"at one split's folder, e.g. {p / sorted(ds)[0]}"
        )
    return ds


def _diagnose_jsonl(p: Path) -> str | None:
    """The first line of a jsonl file that is not a JSON object (`file:line: ...`, 1-based);
    None if there is none."""
    try:
        for line_no, row in json_rows(p):
            if not isinstance(row, dict):
                return f"{p}:{line_no}: a JSON {type(row).__name__}, not an object"
    except DataError as e:
        return str(e).split(". Fix", 1)[0]
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def read_prompts(cfg: DataConfig, tokenizer: Any) -> tuple[list[Prompt], int]:
    """Every prompt of `cfg.train_files` within `cfg.max_prompt_tokens`, and how many were not."""
    files = cfg.train_files
    if isinstance(files, str):
        raise ConfigError(f"data.train_files={files!r}: set it to a list, e.g. "
                          "data.train_files=[path/to/train.jsonl]")
    prompts: list[Prompt] = []
    filtered = 0
    for path in files:
        table = read_table(path)
        file_prompts, file_filtered = _table_prompts(table, Path(path), cfg, tokenizer)
        log.info("%s: %d prompts, %d longer than data.max_prompt_tokens=%d",
                 path, len(file_prompts), file_filtered, cfg.max_prompt_tokens)
        prompts += file_prompts
        filtered += file_filtered
    if not prompts and not filtered:
        raise DataError(f"{', '.join(map(str, files))}: no rows. Fix: point data.train_files "
                        "at files with prompts")
    if not prompts:
        raise DataError(
            f"{', '.join(map(str, files))}: all {filtered} prompts are longer than "
            f"data.max_prompt_tokens={cfg.max_prompt_tokens}. Fix: raise data.max_prompt_tokens"
        )
    if filtered:
        log.warning("dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
                    filtered, filtered + len(prompts), cfg.max_prompt_tokens)
    return prompts, filtered


def table_column(table: Table, key: str, option: str, path: Path) -> list[Any]:
    """The column `key` of a read table (DataError naming the config `option` if absent)."""
    if key not in table.column_names:
        raise DataError(
            f"{path}: no column {key!r} ({option}); the columns are {table.column_names}. "
            f"Fix: set {option}=<one of the columns>"
        )
    return table.read(key)


def _table_prompts(
    table: Table, path: Path, cfg: DataConfig, tokenizer: Any
) -> tuple[list[Prompt], int]:
    cells = table_column(table, cfg.prompt_key, "data.prompt_key", path)
    labels = table_column(table, cfg.label_key, "data.label_key", path)
    metas = (table_column(table, cfg.metadata_key, "data.metadata_key", path)
             if cfg.metadata_key else [None] * len(cells))
    ids = (table_column(table, ID_COLUMN, "", path) if ID_COLUMN in table.column_names
           else [None] * len(cells))
    media_columns = {kind: table_column(table, key, f"data.multimodal_keys.{kind}", path)
                     for kind, key in cfg.multimodal_keys.items()}
    markers = media_markers(tokenizer, cfg) if media_columns else {}
    media: list[dict[str, list[MediaRef]]] = []
    conversations = []
    for row, (cell, label, meta) in enumerate(zip(cells, labels, metas)):
        where = f"{path}, row {row}"
        if cell is None:
            raise DataError(f"{where}, key {cfg.prompt_key!r}: missing. Fix: fill it in, or set "
                            "data.prompt_key=<the column holding prompts>")
        if label is None:
            raise DataError(f"{where}, key {cfg.label_key!r}: missing. Fix: fill it in, or set "
                            "data.label_key=<the column holding reference answers>")
        if meta is not None and not isinstance(meta, Mapping):
            raise DataError(f"{where}, key {cfg.metadata_key!r}: expected a dict, got "
                            f"{type(meta).__name__}. Fix: set data.metadata_key to a column of "
                            "dicts, or to null")
        try:
            conversations.append(to_messages(cell, cfg.system_prompt))
        except TypeError as e:
            raise DataError(f"{where}, key {cfg.prompt_key!r}: {e}. Fix: set data.prompt_key to "
                            "a column of strings or chat messages") from e
        if media_columns:
            conversations[-1], row_items = _row_media(conversations[-1], media_columns, row,
                                                      path, cfg, markers)
            media.append(row_items)

    texts, input_ids = encode_batch(tokenizer, conversations, cfg.apply_chat_template)
    prompts, filtered = [], 0
    for row, (text, tokens) in enumerate(zip(texts, input_ids)):
        if len(tokens) > cfg.max_prompt_tokens:
            filtered += 1
            continue
        prompt_id = str(ids[row]) if ids[row] is not None else f"{path.name}:{row}"
        prompts.append(Prompt(prompt_id=prompt_id, input_ids=tokens, text=text, label=labels[row],
                              metadata=dict(metas[row]) if metas[row] is not None else {},
                              media=media[row] if media else {}))
    return prompts, filtered


def media_markers(tokenizer: Any, cfg: DataConfig) -> dict[str, str]:
    """kind -> the model's marker text for each kind of data.multimodal_keys; ConfigError if the
    tokenizer has no tokens for a kind."""
    from relax_slurm.data.processor import model_markers

    found = model_markers(tokenizer.get_vocab())
    kinds = cfg.media_kinds
    if cfg.audio_from_video and "audio" not in found:
        raise ConfigError("data.audio_from_video=true, but the tokenizer has no audio tokens "
                          "(<|audio_bos|><|AUDIO|><|audio_eos|>): the model does not hear. Fix: "
                          "set data.audio_from_video=false, or use an Omni model")
    missing = [k for k in kinds if k not in found]
    if missing:
        raise ConfigError(
            f"data.multimodal_keys has {missing} but the tokenizer has no tokens for them (it "
            "needs e.g. <|vision_start|><|image_pad|><|vision_end|> or "
            "<|audio_bos|><|AUDIO|><|audio_eos|>, <|video_pad|> for videos). Fix: use the "
            "multimodal model's tokenizer")
    return {k: "".join(found[k]) for k in kinds}


def _row_media(messages: list[dict[str, str]], columns: dict[str, list[Any]], row: int,
               path: Path, cfg: DataConfig, markers: dict[str, str]
               ) -> tuple[list[dict[str, str]], dict[str, list[MediaRef]]]:
    """The row's media items (checked: files exist, images open, one placeholder per item) and
    its messages with the placeholders replaced by the model's markers."""
    items = {kind: row_media(col[row], kind, path.parent,
                             f"{path}, row {row}, key {cfg.multimodal_keys[kind]!r}")
             for kind, col in columns.items()}
    if cfg.add_missing_placeholders:
        messages = add_placeholders(messages, items)
    check_counts("".join(m["content"] for m in messages), items,
                 f"{path}, row {row}, key {cfg.prompt_key!r}")
    for ref in items.get("image", ()):
        check_image(ref)
    sounding = [check_video(ref) for ref in items.get("video", ())]
    if cfg.audio_from_video:
        messages, items = add_video_tracks(messages, items, sounding, cfg.audio_sampling_rate_hz)
    return ([{**m, "content": replace_placeholders(m["content"], markers)} for m in messages],
            items)


class PromptDataset:
    """An iterator of `Prompt`s: `data.num_epochs` passes, reshuffled per epoch, resumable.

    It is its own iterator: iterating again continues where it stopped (use `load_state_dict`
    to rewind).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.prompts, self.num_filtered = read_prompts(cfg, tokenizer)
        self.seed = cfg.seed
        self.epoch = 0
        self.index = 0  # position of the next prompt in this epoch's order
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        """The i-th prompt in file order (not shuffled)."""
        return self.prompts[i]

    def __iter__(self) -> PromptDataset:
        return self

    def __next__(self) -> Prompt:
        while self.epoch < self.cfg.num_epochs:
            if self.index < len(self.prompts):
                i = self._epoch_order()[self.index]
                self.index += 1
                return self.prompts[i]
            self.epoch += 1
            self.index = 0
        raise StopIteration

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.prompts)
            self._order = (np.random.default_rng(self.seed + self.epoch).permutation(n)
                           if self.cfg.shuffle else np.arange(n))
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_rows": len(self.prompts)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        missing = {"epoch", "index", "seed"} - set(state)
        if missing:
            raise DataError(f"dataset state {dict(state)} lacks {sorted(missing)}: it was not "
                            "written by PromptDataset.state_dict")
        if "num_rows" in state and state["num_rows"] != len(self.prompts):
            raise DataError(
                f"the checkpoint's dataset had {state['num_rows']} prompts, this one has "
                f"{len(self.prompts)}: data.train_files or data.max_prompt_tokens changed since. "
                "Fix: resume with the same data settings, or start a new run_dir"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed = int(state["seed"])
        self._order_epoch = -1
