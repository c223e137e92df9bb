"""Safetensors shards written as an exporter hands out tensors (checkpoint/hf_files.py
ShardWriter, write_hf_stream): the megatron trainer's save_hf streams the bridge's export into
them instead of holding the whole model on every rank (issue #34)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from relax_slurm.checkpoint.hf_files import ShardWriter, write_hf_dir, write_hf_stream
from relax_slurm.checkpoint.outputs import natural_key

MB = 2**20


def reused_buffer(n: int):
    """n 1 MiB float32 tensors, each handed out in one buffer refilled for the next, as an
    exporter that gathers into a kept buffer does."""
    buf = torch.empty(MB // 4)
    for i in range(n):
        buf.fill_(float(i))
        yield f"layers.{i}.weight", buf


def test_a_stream_is_written_one_shard_at_a_time_with_every_tensor_as_it_was(tmp_path):
    writer = ShardWriter(tmp_path, shard_size_mb=2.5)
    for name, t in reused_buffer(10):
        writer.add(name, t)
    writer.finish()
    # two 1 MiB tensors fill a 2.5 MiB shard: five shards, never more than one held
    assert writer.peak_held == 2 * MB
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 10 * MB
    loaded = {}
    for f in files:
        part = load_file(str(tmp_path / f))
        assert all(index["weight_map"][k] == f for k in part)
        loaded.update(part)
    # each tensor holds its own value, not the buffer's last one
    assert {k: v.unique().tolist() for k, v in loaded.items()} == {
        f"layers.{i}.weight": [float(i)] for i in range(10)}


def test_one_shard_is_named_model_safetensors_without_an_index(tmp_path):
    writer = ShardWriter(tmp_path, shard_size_mb=100)
    writer.add("a", torch.ones(3))
    writer.finish()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_the_stream_writes_what_the_whole_dict_writes(tmp_path):
    config = Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    tensors = {f"model.layers.{i}.w": torch.full((MB // 4,), float(i)) for i in (10, 2, 1)}
    whole = write_hf_dir(dict(tensors), config, tmp_path / "whole", None, shard_size_mb=1.5)
    # in write_hf_dir's order (natural: layer 2 before 10), one 1 MiB tensor per 1.5 MiB shard
    ordered = ((k, tensors[k]) for k in sorted(tensors, key=natural_key))
    stream = write_hf_stream(ordered, config, tmp_path / "stream", None, shard_size_mb=1.5)
    assert sorted(p.name for p in Path(whole).iterdir()) == \
        sorted(p.name for p in Path(stream).iterdir())
    for f in Path(whole).glob("*.safetensors"):
        a, b = load_file(str(f)), load_file(str(Path(stream) / f.name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
