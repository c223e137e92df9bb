"""Seed arithmetic shared by the rollout worker and the hf engine: pure functions of ints."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit over
    every output bit."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def generator_seed(sampling_seed: int) -> int:
    """The seed a row's torch generator takes for SGLang's 64-bit `sampling_seed`.

    torch's CPU generator (mt19937) keeps only a seed's low 32 bits, and the run seed sits in
    bits 40 and up of every sample's seed (rollout/sampling.py sample_seed): passed as is,
    `seed=1` would draw exactly the tokens of `seed=0`. Seeds in [0, 2**32) pass unchanged;
    the others are folded to 32 bits by `mix64`, so every bit counts.

    >>> generator_seed(5), generator_seed((1 << 40) + 5) == generator_seed(5)
    (5, False)
    """
    if 0 <= sampling_seed < 1 << 32:
        return sampling_seed
    return mix64(sampling_seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFF
