"""Synthetic sequence-length mixes for scheduler benchmarks and robustness tests.

``dcp``: megatron's DCP functional test (lognormal, mean 512, sigma 1.2, clipped to
128..2048), whatever the cap; ``scaled``: the same shape scaled by ``cap / 512`` (long sequences
relative to the cap); ``long_tail``: ``scaled`` plus 5 % of sequences from ``2048 * cap / 512``
up to ``N x cap``; ``bimodal``: 80 % short (lognormal around ``cap / 4``) and 20 % long
(``2..8 x cap``). Deterministic for a given ``numpy`` generator.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIXES", "length_mix", "lognormal"]

MIXES = ("dcp", "scaled", "long_tail", "bimodal")


def lognormal(rng: np.random.Generator, count: int, mean: float = 512, sigma: float = 1.2,
              lo: int = 128, hi: int = 2048) -> list[int]:
    """``count`` lengths from a lognormal with this *mean*, clipped to ``[lo, hi]``."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, count), lo, hi).astype(int).tolist()


def length_mix(name: str, rng: np.random.Generator, count: int, n: int, cap: int) -> list[int]:
    """``count`` lengths of mix ``name`` (module docstring) for ``n`` ranks at ``cap``."""
    f = cap / 512
    if name == "dcp":
        return lognormal(rng, count)
    scaled = lognormal(rng, count, 512 * f, 1.2, max(1, int(128 * f)), int(2048 * f))
    if name == "scaled":
        return scaled
    if name == "long_tail":
        tail = rng.random(count) < 0.05
        longs = rng.integers(int(2048 * f), max(int(2048 * f) + 1, n * cap - 2 * n), size=count)
        return [int(x) if t else b for b, t, x in zip(scaled, tail, longs)]
    if name == "bimodal":
        short = lognormal(rng, count, cap / 4, 0.5, 16, cap)
        long = rng.random(count) < 0.2
        longs = rng.integers(2 * cap, 8 * cap + 1, size=count)
        return [int(x) if t else b for b, t, x in zip(short, long, longs)]
    raise ValueError(f"length mix {name!r}: use one of {', '.join(MIXES)}")
