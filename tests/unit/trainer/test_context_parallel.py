"""Context parallelism's decision and sequence bookkeeping (trainer/megatron/context_parallel.py).

The CP attention itself runs only in transformer-engine on GPUs (not here); what is ours is
tested: when CP is refused and why, which positions each CP rank holds, and that the gathered
chunks put the sequence back in order (and send each rank its gradient, on 2 gloo ranks).
"""

from __future__ import annotations

import pytest
import torch

from relax_slurm.trainer.megatron.context_parallel import (
    chunk_positions, local_tokens, machine_support, padded_length, reassemble, refusal,
)


def test_refusal_names_the_reason_and_the_fix():
    assert refusal(1, cuda=False, te=False) is None  # CP off: runs anywhere
    assert refusal(2, cuda=True, te=True) is None
    cpu = refusal(2, cuda=False, te=False)
    assert "needs GPUs" in cpu
    assert "DotProductAttention asserts context_parallel_size == 1" in cpu
    assert "trainer.context_parallel_size=1" in cpu
    assert "needs GPUs" in refusal(4, cuda=False, te=True)  # TE without CUDA does not help
    no_te = refusal(2, cuda=True, te=False)
    assert "needs transformer-engine" in no_te and '".[gpu]"' in no_te


def test_this_machine_refuses_cp_without_cuda():
    cuda, te = machine_support()
    if not cuda:
        assert refusal(2, cuda=cuda, te=te) is not None


def test_megatron_backend_refuses_cp_on_cpu_at_start():
    pytest.importorskip("megatron.core")
    from relax_slurm.config.trainer import TrainerConfig
    from relax_slurm.errors import ConfigError
    from relax_slurm.trainer.megatron.model import init_model_parallel

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: CP may run")
    # config-time validation accepts CP (the trainer may run on other machines than the launcher)
    cfg = TrainerConfig(backend="megatron", context_parallel_size=2, nproc_per_node=2)
    with pytest.raises(ConfigError, match="needs GPUs"):
        init_model_parallel(cfg)  # refused before any process group is touched


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunks_cover_the_sequence_once_and_balance_causal_work(cp):
    T = padded_length(21, cp)
    assert T % (2 * cp) == 0 and 21 <= T < 21 + 2 * cp
    held = [chunk_positions(T, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(T))
    # causal work of a position ~ its index: every rank holds the same total
    assert len({int(h.sum()) for h in held}) == 1


@pytest.mark.parametrize("cp", [2, 3])
def test_local_tokens_and_reassemble_are_inverse(cp):
    ids = torch.arange(2 * 13).view(2, 13) + 1  # [B=2, T=13]: padded to a multiple of 2*cp
    parts, positions = zip(*(local_tokens(ids, cp, r) for r in range(cp)))
    for part, pos in zip(parts, positions):
        assert part.shape == (2, padded_length(13, cp) // cp)
        real = pos < 13
        assert torch.equal(part[:, real], ids[:, pos[real]])
        assert (part[:, ~real] == 0).all()  # right padding, after every real token
    whole = reassemble(list(parts), cp)
    assert torch.equal(whole[:, :13], ids)
    # logits-shaped parts [B, T/cp, V] reassemble the same way
    logits = torch.randn(2, padded_length(13, cp), 5)
    local = [logits.index_select(1, p) for p in positions]
    assert torch.equal(reassemble(local, cp), logits)


@pytest.mark.parametrize("cp, tp", [(2, 2), (2, 4), (3, 2)])
def test_each_cp_ranks_tokens_split_over_the_sequence_parallel_ranks(cp, tp):
    # sequence parallelism splits each CP rank's T/CP tokens again over TP (megatron-core
    # asserts it divides): 2 x CP alone gave T/CP = 11 for 21 tokens at CP=2, TP=2
    for width in (21, 13, 2 * cp * tp):
        T = padded_length(width, cp, tp)
        assert T % (2 * cp * tp) == 0 and width <= T < width + 2 * cp * tp
        ids = torch.arange(width).view(1, width) + 1
        part, pos = local_tokens(ids, cp, 0, tp)
        assert part.shape[1] == T // cp and (T // cp) % tp == 0
        assert torch.equal(torch.sort(torch.cat([local_tokens(ids, cp, r, tp)[1]
                                                 for r in range(cp)])).values, torch.arange(T))


def _gather_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from relax_slurm.trainer.megatron.context_parallel import _GatherSequence

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        full = torch.randn(2, 8, 3, generator=g)    # [B, T_pad, V]: the whole sequence's logits
        weights = torch.randn(2, 8, 3, generator=g)  # d loss / d logits
        local = full.index_select(1, chunk_positions(8, 2, rank)).requires_grad_()
        whole = _GatherSequence.apply(local, dist.group.WORLD, 2, rank)
        (whole * weights).sum().backward()
        torch.save({"whole": whole.detach(), "grad": local.grad, "full": full,
                    "weights": weights}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_gathered_logits_are_the_sequence_and_each_rank_gets_its_gradient(tmp_path):
    """The CP logits gather on 2 gloo ranks (the collective, not the attention): every rank sees
    the whole sequence in order, and the backward hands each rank its own positions' gradient."""
    import torch.multiprocessing as mp

    mp.spawn(_gather_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2,
             join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"out.{rank}")
        assert torch.equal(r["whole"], r["full"])
        assert torch.equal(r["grad"], r["weights"].index_select(1, chunk_positions(8, 2, rank)))
