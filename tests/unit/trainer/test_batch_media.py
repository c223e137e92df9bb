"""Media tensors in the trainer's batch: collated per row, cut with micro-batches, scattered
with their rows to the ranks (two real gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.samples import Sample
from relax_slurm.trainer.batch import collate, prepare_items, scatter_batch


def samples() -> list[list[Sample]]:
    """Two groups of two; rows carry 1, 1, 2 and 0 images of 4 patches each."""
    def image(seed: int, n: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"pixel_values": rng.standard_normal((4 * n, 6)).astype(np.float32),
                "image_grid_thw": np.tile(np.array([[1, 2, 2]], np.int64), (n, 1))} if n else {}
    out = []
    for i, n in enumerate([1, 1, 2, 0]):
        out.append(Sample(prompt_id=str(i // 2), group_id=i // 2, prompt_ids=[1, 2, 3],
                          response_ids=[4, 5][: 1 + i % 2], loss_mask=[1.0] * (1 + i % 2),
                          rollout_logprobs=[-1.0] * (1 + i % 2), reward=float(i % 2),
                          mm_inputs=image(i, n)))
    return [out[:2], out[2:]]


def test_collate_and_micro_batches() -> None:
    groups = samples()
    mb = collate(prepare_items(groups, AlgoConfig()), 0, torch.device("cpu"))
    assert mb.media.counts == {"image_grid_thw": (1, 1, 2, 0), "pixel_values": (4, 4, 8, 0)}
    part = mb.rows(1, 3)
    np.testing.assert_array_equal(
        part.media.tensors["pixel_values"].numpy(),
        np.concatenate([groups[0][1].mm_inputs["pixel_values"],
                        groups[1][0].mm_inputs["pixel_values"]]))
    assert set(mb.rows(3, 4).forward_kwargs()) == {"input_ids", "attention_mask"}  # no images


def _rank(rank: int, store: str, out: str, data_ranks: list[int] | None = None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        whole = (collate(prepare_items(samples(), AlgoConfig()), 0, torch.device("cpu"))
                 if rank == 0 else None)
        mine = scatter_batch(whole, torch.device("cpu"), data_ranks)
        torch.save({"counts": mine.media.counts,
                    "pixels": mine.media.tensors["pixel_values"],
                    "ids": mine.input_ids}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_scatter_sends_each_rank_its_rows_media(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    groups = samples()
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0["counts"]["pixel_values"] == (4, 4) and r1["counts"]["pixel_values"] == (8, 0)
    np.testing.assert_array_equal(r1["pixels"].numpy(), groups[1][0].mm_inputs["pixel_values"])
    np.testing.assert_array_equal(
        r0["pixels"].numpy(), np.concatenate([s.mm_inputs["pixel_values"] for s in groups[0]]))


def test_tensor_parallel_peers_get_the_same_rows_media(tmp_path: Path) -> None:
    """Two TP peers of one data-parallel rank (data_ranks [0, 0]): both hold all rows and their
    media (the trainer=megatron VL forward runs the same rows on both)."""
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "out"), [0, 0]), nprocs=2,
             join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0["counts"]["pixel_values"] == r1["counts"]["pixel_values"] == (4, 4, 8, 0)
    assert torch.equal(r0["pixels"], r1["pixels"]) and torch.equal(r0["ids"], r1["ids"])


def test_freeze_modules_by_prefix_and_the_fix_for_a_typo() -> None:
    import pytest

    from relax_slurm.errors import ConfigError
    from relax_slurm.trainer.model import build_optimizer, freeze_modules
    from relax_slurm.config.trainer import TrainerConfig

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.visual = torch.nn.Linear(2, 2)
    model.model.visual_extra = torch.nn.Linear(2, 2)  # a prefix match of names, not modules
    model.lm_head = torch.nn.Linear(2, 3)
    assert freeze_modules(model, ["model.visual"]) == 6
    assert model.model.visual_extra.weight.requires_grad and model.lm_head.weight.requires_grad
    opt, _ = build_optimizer(model, TrainerConfig())
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 6 + 9
    with pytest.raises(ConfigError, match=r"'model.vision' matches no parameter.*model.visual"):
        freeze_modules(model, ["model.vision"])
