"""Deterministic mock data for tiny GPT runs, cut for data and context parallelism.

Every rank draws the same global batch from ``(seed, step)``, so TP ranks need no broadcast and
runs with different parallel layouts see identical data.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..sharding import DEFAULT_CP_PARTITION_MODE, MicroBatch, get_local_chunk

__all__ = [
    "CORPORA",
    "MicroBatch",
    "global_batch",
    "markov_sample",
    "static_cp_micro_batches",
    "varlen_lengths",
    "varlen_sample",
]


def global_batch(seed: int, step: int, batch: int, seq_length: int, vocab: int
                 ) -> dict[str, torch.Tensor]:
    """``batch`` rows of ``seq_length`` tokens (inputs, labels shifted by one, loss mask)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    # A learnable signal: each row repeats a short random motif, with noise.
    period = 7
    motif = torch.randint(0, vocab, (batch, period), generator=gen)
    text = motif.repeat(1, seq_length // period + 2)[:, : seq_length + 1]
    noise = torch.rand(text.shape, generator=gen) < 0.1
    text = torch.where(noise, torch.randint(0, vocab, text.shape, generator=gen), text)
    loss_mask = torch.ones(batch, seq_length)
    loss_mask[:, :2] = 0.0  # a few masked tokens keep the per-token reduction honest
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": loss_mask}


def static_cp_micro_batches(
    data: dict[str, torch.Tensor],
    *,
    dp_size: int,
    dp_rank: int,
    micro_batch_size: int,
    cp_size: int,
    cp_rank: int,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> list[MicroBatch]:
    """This DP rank's micro-batches, each cut to this CP rank's part in ``cp_partition_mode``
    (zigzag: the load-balanced chunks; contiguous: its slice)."""
    rows = data["tokens"].shape[0]
    per_dp = rows // dp_size
    mine = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    seq = data["tokens"].shape[1]
    positions = torch.arange(seq).expand(rows, seq)

    def cut(x: torch.Tensor, part: slice) -> torch.Tensor:
        if cp_size == 1:
            return x[part]
        return get_local_chunk(x[part], cp_size, cp_rank, "bshd",
                               cp_partition_mode=cp_partition_mode)

    out = []
    for start in range(mine.start, mine.stop, micro_batch_size):
        part = slice(start, start + micro_batch_size)
        out.append(MicroBatch(*(cut(x, part) for x in (
            data["tokens"], data["labels"], data["loss_mask"], positions))))
    return out


def varlen_lengths(seed: int, step: int, batch: int, *, min_len: int, max_len: int,
                   mean: float, sigma: float) -> list[int]:
    """Sequence lengths of one global batch: a lognormal with median ``mean`` and shape
    ``sigma``, clipped to ``[min_len, max_len]`` (upstream's variable-length mock data)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len={min_len} <= max_len={max_len}")
    rng = np.random.default_rng([seed, step, 1])
    draws = rng.lognormal(mean=math.log(mean), sigma=sigma, size=batch)
    return [int(x) for x in np.clip(np.rint(draws), min_len, max_len)]


def varlen_sample(seed: int, step: int, sample_id: int, length: int, vocab: int
                  ) -> torch.Tensor:
    """Sample ``sample_id`` of a step as an int64 ``[3, length]`` tensor: tokens, labels
    (tokens shifted by one), loss mask (the first two tokens masked). Depends only on its
    arguments, so the rank that loads it can be any rank."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 100_003 + sample_id)
    period = 3 + sample_id % 7
    motif = torch.randint(0, vocab, (period,), generator=gen)
    text = motif.repeat(length // period + 2)[: length + 1]
    noise = torch.rand(text.shape, generator=gen) < 0.1
    text = torch.where(noise, torch.randint(0, vocab, text.shape, generator=gen), text)
    mask = torch.ones(length, dtype=torch.int64)
    mask[: min(2, length)] = 0
    return torch.stack([text[:-1], text[1:], mask])


CORPORA = ("motif", "markov")  # varlen mock corpora: per-sample motifs, a shared Markov chain
MARKOV_STAY = 0.85  # probability that a token is followed by its fixed successor


def markov_sample(seed: int, step: int, sample_id: int, length: int, vocab: int
                  ) -> torch.Tensor:
    """Like :func:`varlen_sample`, from a Markov chain every sample shares: token ``t`` is
    followed by its successor ``succ[t]`` (a permutation drawn from ``seed`` alone) with
    probability :data:`MARKOV_STAY`, else by a uniform token. A model learns the successor table
    within tens of steps (entropy ~1.1 nats per token at vocab 128, against ln(vocab) = 4.85
    before), so the loss visibly falls; the text itself depends on (seed, step, sample)."""
    succ = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed * 7_919 + 17))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 100_003 + sample_id)
    jump = (torch.rand(length + 1, generator=gen) >= MARKOV_STAY).tolist()
    noise = torch.randint(0, vocab, (length + 1,), generator=gen).tolist()
    table = succ.tolist()
    text = [noise[0]]
    for i in range(1, length + 1):
        text.append(noise[i] if jump[i] else table[text[-1]])
    tokens = torch.tensor(text, dtype=torch.int64)
    mask = torch.ones(length, dtype=torch.int64)
    mask[: min(2, length)] = 0
    return torch.stack([tokens[:-1], tokens[1:], mask])
