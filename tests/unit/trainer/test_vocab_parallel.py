"""Log-probs and entropy from vocab-parallel logits (trainer/megatron/vocab_parallel.py) equal
the full-vocabulary ones, gradients included, and no rank builds a tensor as wide as the
vocabulary (issue #34: the step gathered float32 logits over the whole vocabulary, and their
softmax, on every TP rank). Two gloo ranks, each holding half of the vocabulary; float64, so
the only difference is the order of a few sums (bounded below by 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import NEEDS_MEGATRON
from tests.helpers_tiny import free_port, spawned_ranks

pytestmark = NEEDS_MEGATRON
B, T, VOCAB, WIDTH = 3, 5, 10, 12  # an output layer padded past the vocabulary: 2 x 6 columns
BANNED = [4]  # a media pad token, in rank 0's half
TEMPERATURE = 0.7


class Widest(TorchDispatchMode):
    """The widest last dimension of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim():
                self.widest = max(self.widest, t.shape[-1])
        return out


def reference(logits: torch.Tensor, targets: torch.Tensor):
    """The full-vocabulary path (trainer/step.py): padding dropped, banned ids lowest."""
    scaled = logits[..., :VOCAB] / TEMPERATURE
    scaled[..., BANNED] = torch.finfo(scaled.dtype).min
    logp = scaled.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logsm = scaled.log_softmax(-1)  # a banned id's p log p is 0, its gradient too
    entropy = -(logsm.exp() * torch.where(logsm.exp() > 0, logsm, 0.0)).sum(-1)
    return logp, entropy


def _rank(rank: int, port: int, queue) -> None:
    from relax_slurm.trainer.megatron import vocab_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, WIDTH, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    targets[0, 0] = 9  # the last real token, beside the padding columns
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)
    half = WIDTH // 2
    mine = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_()
    with Widest() as seen:
        shard = vocab_parallel.scaled_shard(mine, rank * half, VOCAB, TEMPERATURE, BANNED)
        logp, entropy = vocab_parallel.logprobs_and_entropy(
            shard, targets, rank * half, dist.group.WORLD, entropy="grad")
        ((logp * weights).sum() + (entropy * weights).sum()).backward()
    full = logits.clone().requires_grad_()
    ref_logp, ref_entropy = reference(full, targets)
    ((ref_logp * weights).sum() + (ref_entropy * weights).sum()).backward()
    queue.put((rank, seen.widest, (logp - ref_logp).abs().max().item(),
               (entropy - ref_entropy).abs().max().item(),
               (mine.grad - full.grad[..., rank * half:(rank + 1) * half]).abs().max().item(),
               bool(mine.grad.isnan().any()), bool(full.grad.isnan().any())))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_vocab_parallel_logprobs_and_entropy_equal_the_full_vocabulary_ones():
    results = spawned_ranks(_rank, 2, free_port())
    for rank, widest, d_logp, d_entropy, d_grad, *nans in results:
        assert nans == [False, False], (rank, nans)
        assert widest == WIDTH // 2, (rank, widest)  # never the whole vocabulary
        assert d_logp < 1e-12 and d_entropy < 1e-12, (rank, d_logp, d_entropy)
        assert d_grad < 1e-12, (rank, d_grad)  # the padding columns' included: none
