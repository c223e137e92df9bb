"""The megatron backend's part of sequence parallelism that runs without a GPU: which models get
it (megatron-core trains MoE layers under TP only with it) and the right-padding of rows to a
multiple of TP, which megatron's sequence split needs (the forward itself is GPU-only)."""

from __future__ import annotations

import torch

from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.megatron.model import MegatronModel, needs_sequence_parallel


def test_only_moe_under_tensor_parallelism_needs_it():
    assert needs_sequence_parallel(128, 2) and needs_sequence_parallel(4, 8)
    assert not needs_sequence_parallel(128, 1)
    assert not needs_sequence_parallel(None, 2) and not needs_sequence_parallel(0, 2)


def model_at(tp: int, sequence_parallel: bool) -> MegatronModel:
    """The padding reads only these two fields (no model is built)."""
    mm = MegatronModel.__new__(MegatronModel)
    mm.cfg = TrainerConfig(backend="megatron", tensor_parallel_size=tp, nproc_per_node=tp)
    mm.sequence_parallel = sequence_parallel
    return mm


def test_rows_padded_to_a_multiple_of_tp_after_every_token():
    ids = torch.arange(1, 8).view(1, 7).repeat(2, 1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # the second row is right-padded already
    padded, pmask = model_at(4, True)._pad_for_sequence_parallel(ids, mask)
    assert padded.shape == pmask.shape == (2, 8)
    assert torch.equal(padded[:, :7], ids) and not padded[:, 7:].any()
    assert torch.equal(pmask[:, :7], mask) and not pmask[:, 7:].any()
    assert model_at(4, True).seq_length(7, 1) == 8 and model_at(4, True).seq_length(8, 1) == 8
    ids_only, none = model_at(4, True)._pad_for_sequence_parallel(ids, None)
    assert ids_only.shape == (2, 8) and none is None


def test_no_padding_without_sequence_parallelism():
    ids = torch.arange(7).view(1, 7)
    same, _ = model_at(4, False)._pad_for_sequence_parallel(ids, None)
    assert same is ids and model_at(4, False).seq_length(7, 1) == 7
    # context parallelism pads on its own (2 x CP chunks)
    assert model_at(2, True).seq_length(7, 2) == 8
