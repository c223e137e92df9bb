"""PromptDataset: readers, chat rendering, filtering, shuffling, resume and error messages."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from relax_slurm.config.data import DataConfig
from relax_slurm.data import PromptDataset, chat, encode, read_table, to_messages
from relax_slurm.data.chat import _as_ids
from relax_slurm.errors import ConfigError, DataError



@pytest.fixture(scope="module")
def tok():
    from relax_slurm.tiny.model import build_tokenizer

    return build_tokenizer()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arith_rows(n: int) -> list[dict]:
    return [{"prompt": f"{i % 10}+{i // 10 % 10}=", "label": str((i % 10 + i // 10 % 10) % 10),
             "id": f"r{i}"} for i in range(n)]


def cfg(*files, **kw) -> DataConfig:
    return DataConfig(train_files=[str(f) for f in files], **kw)


def chat_ids(tok, messages) -> list[int]:
    return _as_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


# ---- readers ----------------------------------------------------------------------------------

def test_jsonl(tmp_path, tok):
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "a.jsonl", arith_rows(30)), shuffle=False), tok)
    assert len(ds) == 30 and ds.num_filtered == 0
    p = next(ds)
    assert (p.prompt_id, p.text, p.label, p.metadata) == ("r0", "0+0=", "0", {})
    assert p.input_ids == tok("0+0=", add_special_tokens=False)["input_ids"]
    # the batched path gives what apply_chat_template(tokenize=True) gives, row by row
    for q in ds.prompts:
        assert q.input_ids == chat_ids(tok, [{"role": "user", "content": q.text}])


def test_jsonl_rows_keep_their_own_values_and_lack_keys_as_none(tmp_path):
    """A .jsonl file is read line by line (no datasets schema across rows): a key a row lacks
    reads None, a column's values keep each row's type, nested dicts their own keys."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "1+1=", "label": 2, "meta": {"a": 1}}\n\n'
                    '{"prompt": "2+2=", "label": "4", "meta": {"b": [1, 2]}, "id": "x"}\n')
    table = read_table(path)
    assert table.column_names == ["prompt", "label", "meta", "id"]
    assert table.read("label") == [2, "4"]
    assert table.read("meta") == [{"a": 1}, {"b": [1, 2]}]
    assert table.read("id") == [None, "x"]


def test_parquet_with_metadata_and_no_id_column(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{"q": "1+2=", "a": 3, "meta": {"source": "x"}}, {"q": "2+2=", "a": 4, "meta": None}]
    ), path)
    ds = PromptDataset(cfg(path, prompt_key="q", label_key="a", metadata_key="meta",
                           shuffle=False), tok)
    a, b = list(ds)[:2]
    assert (a.prompt_id, a.label, a.metadata) == ("b.parquet:0", 3, {"source": "x"})
    assert (b.prompt_id, b.metadata) == ("b.parquet:1", {})


def test_saved_dataset_folder_and_concatenation(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list(arith_rows(5)).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(arith_rows(3))}).save_to_disk(
        str(tmp_path / "splits"))
    jsonl = write_jsonl(tmp_path / "c.jsonl", arith_rows(2))
    ds = PromptDataset(cfg(tmp_path / "plain", jsonl, tmp_path / "splits", shuffle=False,
                           num_epochs=1), tok)
    assert len(ds) == 10
    assert [p.prompt_id for p in ds] == [f"r{i}" for i in (0, 1, 2, 3, 4, 0, 1, 0, 1, 2)]


# ---- rendering --------------------------------------------------------------------------------

def test_chat_message_prompts_and_system_prompt(tmp_path, tok):
    rows = [
        {"prompt": [{"role": "system", "content": "1+1=2 "}, {"role": "user", "content": "3+4="}],
         "label": "7"},
        {"prompt": [{"role": "user", "content": "5+5="}], "label": "0"},
    ]
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "m.jsonl", rows), system_prompt="0+0=0 ",
                           shuffle=False), tok)
    first, second = ds[0], ds[1]
    assert first.text == "1+1=2 3+4="  # the row's own system message is kept, not doubled
    assert second.text == "0+0=0 5+5="
    assert second.input_ids == tok("0+0=0 5+5=", add_special_tokens=False)["input_ids"]


def test_raw_text_mode_joins_messages(tmp_path, tok):
    # one file mixing both prompt forms (datasets reads such a column as Json and decodes it)
    rows = [{"prompt": [{"role": "user", "content": "1+1="}, {"role": "user", "content": "2"}],
             "label": "x"}, {"prompt": "3+4=", "label": "7"}]
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "r.jsonl", rows), apply_chat_template=False,
                           shuffle=False), tok)
    assert ds[0].text == "1+1=\n2"
    assert ds[1].text == "3+4=" and ds[1].input_ids == tok("3+4=")["input_ids"]


def test_chat_doctests():
    assert doctest.testmod(chat).failed == 0


def test_encode_accepts_every_apply_chat_template_return_type(tok):
    messages = to_messages("3+4=")
    want = tok("3+4=", add_special_tokens=False)["input_ids"]
    assert encode(tok, messages, True) == ("3+4=", want)
    batch_encoding = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)
    for out in (want, [want], {"input_ids": want}, {"input_ids": [want]}, batch_encoding):
        assert _as_ids(out) == want


def test_filtering_counts_long_prompts(tmp_path, tok):
    rows = [{"prompt": "1" * n, "label": "1"} for n in (2, 4, 5, 9, 3)]
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "f.jsonl", rows), max_prompt_tokens=4), tok)
    assert (len(ds), ds.num_filtered) == (3, 2)
    with pytest.raises(DataError, match="data.max_prompt_tokens"):
        PromptDataset(cfg(write_jsonl(tmp_path / "g.jsonl", rows), max_prompt_tokens=1), tok)


# ---- iteration --------------------------------------------------------------------------------

def test_shuffle_is_deterministic_per_epoch_and_stops(tmp_path, tok):
    path = write_jsonl(tmp_path / "s.jsonl", arith_rows(20))
    run = lambda **kw: [p.prompt_id for p in PromptDataset(cfg(path, num_epochs=3, **kw), tok)]
    a, b = run(seed=1), run(seed=1)
    assert a == b and len(a) == 60
    epochs = [a[i * 20:(i + 1) * 20] for i in range(3)]
    assert all(sorted(e) == sorted(f"r{i}" for i in range(20)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert run(seed=2) != a
    assert run(shuffle=False) == [f"r{i}" for i in range(20)] * 3


@pytest.mark.parametrize("consumed", [0, 7, 20, 33])
def test_state_dict_resumes_exactly(tmp_path, tok, consumed):
    path = write_jsonl(tmp_path / "s.jsonl", arith_rows(20))
    reference = [p.prompt_id for p in PromptDataset(cfg(path, num_epochs=2, seed=5), tok)]
    ds = PromptDataset(cfg(path, num_epochs=2, seed=5), tok)
    for _ in range(consumed):
        next(ds)
    state = json.loads(json.dumps(ds.state_dict()))  # survives a checkpoint file
    resumed = PromptDataset(cfg(path, num_epochs=2, seed=99), tok)  # seed comes from the state
    resumed.load_state_dict(state)
    assert [p.prompt_id for p in resumed] == reference[consumed:]


def test_state_from_other_data_is_refused(tmp_path, tok):
    ds = PromptDataset(cfg(write_jsonl(tmp_path / "s.jsonl", arith_rows(20))), tok)
    with pytest.raises(DataError, match="prompts"):
        ds.load_state_dict({"epoch": 0, "index": 3, "seed": 0, "num_rows": 21})


# ---- errors name file, row and key ------------------------------------------------------------

def _bad(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    return path


ERROR_CASES = {
    # name: (file name, content, DataConfig overrides, expected fragments besides the path)
    "missing key in a row": ("k.jsonl", '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2="}\n',
                             {}, ["row 1", "'label'", "data.label_key"]),
    "missing column": ("c.jsonl", '{"question": "1+1=", "label": "2"}\n', {},
                       ["no column", "'prompt'", "data.prompt_key", "question"]),
    "wrong prompt type": ("t.jsonl", '{"prompt": 5, "label": "2"}\n', {},
                          ["row 0", "'prompt'", "data.prompt_key", "int"]),
    "bad message": ("m.jsonl", '{"prompt": [{"role": "user"}], "label": "2"}\n', {},
                    ["row 0", "'prompt'", "content"]),
    "metadata not a dict": ("d.jsonl", '{"prompt": "1=", "label": "1", "meta": "x"}\n',
                            {"metadata_key": "meta"}, ["row 0", "'meta'", "data.metadata_key"]),
    "invalid json": ("j.jsonl", '{"prompt": "1=", "label": "1"}\n{"prompt": \n', {},
                     ["j.jsonl:2", "not valid JSON"]),
    "not an object": ("o.jsonl", '{"prompt": "1=", "label": "1"}\n[1, 2]\n', {},
                      ["o.jsonl:2", "not an object"]),
    "unknown suffix": ("u.txt", "1+1=\n", {}, [".jsonl"]),
    "empty file": ("e.jsonl", "", {}, ["empty"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_name_file_row_and_key(tmp_path, tok, case):
    name, content, overrides, fragments = ERROR_CASES[case]
    path = _bad(tmp_path, name, content)
    with pytest.raises(DataError) as e:
        PromptDataset(cfg(path, **overrides), tok)
    msg = str(e.value)
    assert str(path) in msg and "Fix" in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_missing_file_and_unset_files(tmp_path, tok):
    with pytest.raises(DataError, match="no such file.*data.train_files"):
        PromptDataset(cfg(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(ConfigError, match="data.train_files"):
        PromptDataset(DataConfig(), tok)
