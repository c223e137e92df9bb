"""trainer.towers=split's cut of a tower call's items over the TP ranks (tower_split.blocks):
contiguous, in order, none empty, each rank about its share of the rows. The gather and the
gradients against transformers: test_megatron_vl.py's *_split rows."""

from __future__ import annotations

import pytest

from relax_slurm.trainer.megatron.tower_split import blocks


@pytest.mark.parametrize("rows, parts, expected", [
    ([16, 8], 2, [(0, 1), (1, 2)]),
    ([4, 4, 4, 4], 2, [(0, 2), (2, 4)]),
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),  # one heavy item: a block of its own
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
    ([5, 5, 5], 3, [(0, 1), (1, 2), (2, 3)]),
    ([1, 1, 1, 1, 1, 1, 1, 1], 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
])
def test_blocks_cut_items_contiguously_by_rows(rows, parts, expected):
    assert blocks(rows, parts) == expected


@pytest.mark.parametrize("rows", [[3, 9, 1, 7, 2, 8], [1] * 7, [50, 1, 1, 1, 1, 1, 1, 50]])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_every_item_in_one_block_and_no_block_empty(rows, parts):
    cut = blocks(rows, parts)
    assert len(cut) == parts and cut[0][0] == 0 and cut[-1][1] == len(rows)
    assert all(a < b for a, b in cut)  # none empty: each rank has something to encode
    assert all(cut[i][1] == cut[i + 1][0] for i in range(parts - 1))  # contiguous, in order
