"""The hf engine's seeded draw: inverse-CDF sampling from per-row uniforms."""

from __future__ import annotations

import math

import torch

from relax_slurm.engines.hf.batch import inverse_cdf_sample


def test_draws_follow_the_softmax():
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf, math.log(6.0)]])  # p = .1 .3 0 .6
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = inverse_cdf_sample(logits.expand(n, -1), u).squeeze(1)
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[2] == 0  # a -inf logit is never drawn
    assert torch.allclose(freq, torch.tensor([0.1, 0.3, 0.0, 0.6], dtype=torch.float64),
                          atol=0.015), freq


def test_edges_of_the_unit_interval_pick_possible_tokens():
    logits = torch.tensor([[-math.inf, 0.0, 0.0, -math.inf]] * 2)
    # float32: 1 - 1e-12 rounds to 1.0, which must still land on the last possible token
    tokens = inverse_cdf_sample(logits, torch.tensor([0.0, 1.0 - 1e-12]))
    assert tokens.squeeze(1).tolist() == [1, 2]


def test_rows_are_independent():
    logits = torch.tensor([[5.0, -math.inf], [-math.inf, 5.0]])
    assert inverse_cdf_sample(logits, torch.tensor([0.5, 0.5])).squeeze(1).tolist() == [0, 1]


def test_the_run_seed_changes_the_draws():
    """sample_seed puts the run seed in bits 40+, which torch's mt19937 would drop."""
    from relax_slurm.engines.seeds import generator_seed
    from relax_slurm.rollout.sampling import sample_seed

    def draws(seed: int) -> list[float]:
        g = torch.Generator().manual_seed(generator_seed(seed))
        return torch.rand(4, generator=g).tolist()

    group, index, n = 7, 3, 16
    runs = [draws(sample_seed(run, group, index, n)) for run in range(4)]
    assert len({tuple(r) for r in runs}) == 4  # every run seed its own stream
    assert generator_seed(sample_seed(0, group, index, n)) == group * n + index  # seed 0 as before
    assert all(0 <= generator_seed(s) < 2 ** 32 for s in (2 ** 32, 2 ** 63 - 1, -1))
    # folded seeds of one run stay distinct across its samples
    assert len({generator_seed(sample_seed(1, g, i, n)) for g in range(64) for i in range(n)}) \
        == 64 * n
