"""Which TP shard of the vocabulary holds the pad token's embedding row, and where in it
(relax_slurm/trainer/megatron/pad_embedding.py; the gradient itself against nn.Embedding at
TP=2 is tests/integration/test_megatron_pad_embedding.py)."""

from __future__ import annotations

import pytest

from relax_slurm.trainer.megatron.pad_embedding import local_pad_row


@pytest.mark.parametrize("pad, start, end, row", [
    (0, 0, 16, 0),      # TP=1: the whole vocabulary
    (0, 0, 8, 0),       # TP=2, rank 0
    (0, 8, 16, None),   # TP=2, rank 1: not its row
    (11, 0, 8, None),
    (11, 8, 16, 3),
    (8, 8, 16, 0),      # a shard's first row
    (7, 0, 8, 7),       # a shard's last row
])
def test_the_pad_row_is_in_the_one_shard_whose_range_holds_it(pad, start, end, row):
    assert local_pad_row(pad, start, end) == row
