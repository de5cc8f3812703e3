"""Dynamic-CP scheduler: sequences of a global batch -> micro-batches of aligned CP groups.

Every micro-batch partitions the ``N`` DPxCP ranks into contiguous, aligned power-of-two blocks
(the dynamic CP groups); each block runs some sequences, each split over the whole block. A
micro-batch ends in a barrier, so a step costs the sum over micro-batches of the slowest rank.

Algorithm (deterministic, vectorised with numpy):

1. every sequence gets the smallest power-of-two group (>= ``min_cp_size``) whose ranks hold at
   most ``cap`` tokens (:func:`~.workload.min_group_size`);
2. the micro-batch count starts at a lower bound (token capacity; rank slots of sequences that
   fill more than half a rank) rounded up to a multiple of the VPP size, and grows only when a
   sequence finds no legal place;
3. a sequence heavier per rank than the ideal level ``total work / (N * M)`` is spread over the
   smallest larger group that brings it under that level;
4. sequences, largest total work first, go to the legal block (free, or already a group of the
   same size with room under the cap) that raises its micro-batch's slowest rank the least,
   then the least loaded such block;
5. ranks left idle are absorbed by doubling a neighbouring group into its idle buddy block
   (its sequences are then split over twice the ranks); any idle rank that remains is reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .workload import GPTWorkload, ScheduleError, min_group_size, tokens_per_rank

__all__ = ["Group", "MicroBatch", "Plan", "schedule"]


@dataclass(frozen=True)
class Group:
    ranks: tuple[int, ...]
    samples: tuple[int, ...]


@dataclass(frozen=True)
class MicroBatch:
    groups: tuple[Group, ...]
    idle_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    micro_batches: tuple[MicroBatch, ...]
    notes: tuple[str, ...] = ()
    summary: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        return {
            "micro_batches": [
                {"groups": [{"ranks": list(g.ranks), "samples": list(g.samples)}
                            for g in mb.groups],
                 "idle_ranks": list(mb.idle_ranks)}
                for mb in self.micro_batches
            ],
            "notes": list(self.notes),
            "summary": self.summary,
        }


def _check_inputs(lengths, n, cap, min_cp_size, vpp) -> None:
    if n < 1 or n & (n - 1):
        raise ScheduleError(
            f"dp_cp={n}: dynamic CP groups are aligned power-of-two blocks of the DPxCP ranks, "
            "so DPxCP must be a power of two; change the DP or CP size"
        )
    if cap <= 0:
        raise ScheduleError(f"max_seqlen_per_dp_cp_rank={cap} must be > 0")
    if min_cp_size < 1 or min_cp_size & (min_cp_size - 1) or min_cp_size > n:
        raise ScheduleError(
            f"min_cp_size={min_cp_size} must be a power of two <= dp_cp={n}"
        )
    if vpp < 1:
        raise ScheduleError(f"vpp={vpp} must be >= 1")
    if not lengths:
        raise ScheduleError("the global batch is empty; nothing to schedule")
    bad = [i for i, length in enumerate(lengths) if int(length) < 1]
    if bad:
        raise ScheduleError(f"samples {bad[:5]} have length < 1")


def _place(order, sizes, work, tokens, n, m, cap):
    """Greedy placement into ``m`` micro-batches; None if some sample has no legal place."""
    load = np.zeros((m, n))
    tok = np.zeros((m, n), dtype=np.int64)
    gsz = np.zeros((m, n), dtype=np.int64)
    where: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(sizes)
    for s in order:
        c, w, t = sizes[s], work[s], tokens[s]
        blocks = n // c
        g = gsz.reshape(m, blocks, c)
        legal = ((g == 0).all(-1) | (g == c).all(-1)) & (
            tok.reshape(m, blocks, c).max(-1) + t <= cap)
        if not legal.any():
            return None
        new = load.reshape(m, blocks, c).max(-1) + w
        mb_max = load.max(1)[:, None]
        raise_by = np.maximum(mb_max, new) - mb_max
        cand = np.flatnonzero(legal.ravel())
        best = cand[np.lexsort((cand, new.ravel()[cand], raise_by.ravel()[cand]))[0]]
        j, b = divmod(int(best), blocks)
        span = slice(b * c, (b + 1) * c)
        load[j, span] += w
        tok[j, span] += t
        gsz[j, span] = c
        where[s] = (j, b * c, c)
    return where, gsz


def _spread(length: int, size: int, level: float, n: int, cost) -> int:
    """Smallest power-of-two group >= ``size`` whose per-rank cost is <= ``level``."""
    while size < n and cost(length, size) > level:
        size *= 2
    return size


def _absorb_idle(groups: dict, n: int) -> tuple[int, ...]:
    """Double groups into idle buddy blocks (repeatedly); returns the remaining idle ranks."""
    changed = True
    while changed:
        changed = False
        used = np.zeros(n, dtype=bool)
        for (start, size) in groups:
            used[start:start + size] = True
        for (start, size) in sorted(groups, key=lambda k: (-k[1], k[0])):
            buddy = start ^ size
            if buddy + size > n or used[buddy:buddy + size].any():
                continue
            samples = groups.pop((start, size))
            groups[(min(start, buddy), 2 * size)] = samples
            changed = True
            break
    used = np.zeros(n, dtype=bool)
    for (start, size) in groups:
        used[start:start + size] = True
    return tuple(int(r) for r in np.flatnonzero(~used))


def schedule(
    lengths: Sequence[int],
    dp_cp: int,
    max_seqlen_per_rank: int,
    *,
    workload: GPTWorkload | None = None,
    min_cp_size: int = 1,
    vpp: int = 1,
) -> Plan:
    """Schedule the global batch ``lengths`` (sample id = position) on ``dp_cp`` ranks."""
    lengths = [int(x) for x in lengths]
    n, cap = int(dp_cp), int(max_seqlen_per_rank)
    _check_inputs(lengths, n, cap, min_cp_size, vpp)
    model = workload or GPTWorkload()
    sizes = [min_group_size(length, cap, n, min_cp_size) for length in lengths]
    work = [model.cost(length, c) for length, c in zip(lengths, sizes)]
    tokens = [tokens_per_rank(length, c) for length, c in zip(lengths, sizes)]
    order = sorted(range(len(lengths)), key=lambda s: (-work[s] * sizes[s], s))
    # lower bounds: token capacity, and rank slots of sequences that fill more than half a
    # rank's cap (two of them never share a rank)
    m = max(1, math.ceil(sum(t * c for t, c in zip(tokens, sizes)) / (n * cap)),
            math.ceil(sum(c for t, c in zip(tokens, sizes) if 2 * t > cap) / n))
    m = -(-m // vpp) * vpp
    total = sum(w * c for w, c in zip(work, sizes))
    while True:
        # a sequence heavier per rank than the ideal level T would set its micro-batch's pace:
        # spread it over a larger group (fewer tokens and less work per rank)
        level = total / (n * m)
        spread = [_spread(length, c, level, n, model.cost) for length, c in zip(lengths, sizes)]
        placed = _place(order, spread,
                        [model.cost(length, c) for length, c in zip(lengths, spread)],
                        [tokens_per_rank(length, c) for length, c in zip(lengths, spread)],
                        n, m, cap)
        if placed is not None:
            break
        m += vpp
    where, _ = placed
    per_mb: list[dict] = [{} for _ in range(m)]
    for s, (j, start, size) in enumerate(where):
        per_mb[j].setdefault((start, size), []).append(s)
    empty = [j for j, groups in enumerate(per_mb) if not groups]
    drop = set(empty[: len(empty) // vpp * vpp])  # keep the count a multiple of vpp
    per_mb = [groups for j, groups in enumerate(per_mb) if j not in drop]
    m = len(per_mb)
    notes = []
    micro_batches = []
    for j, groups in enumerate(per_mb):
        idle = _absorb_idle(groups, n)
        if idle:
            notes.append(
                f"micro-batch {j}: ranks {list(idle)} idle: no sequence can be placed there "
                f"(the batch has {len(lengths)} sequences for {m} micro-batches of {n} ranks)"
            )
        micro_batches.append(MicroBatch(
            tuple(Group(tuple(range(st, st + sz)), tuple(sorted(v)))
                  for (st, sz), v in sorted(groups.items())), idle))
    plan = Plan(tuple(micro_batches), tuple(notes))
    object.__setattr__(plan, "summary", summarize(plan, lengths, n, cap, model))
    return plan


def summarize(plan: Plan, lengths: Sequence[int], n: int, cap: int,
              workload: GPTWorkload) -> dict:
    """Makespan, efficiency (ideal / makespan), per-micro-batch max/mean, idle slots, tokens."""
    ideal_total = 0.0
    makespan = 0.0
    per_mb = []
    peak_tokens = 0
    for mb in plan.micro_batches:
        load = np.zeros(n)
        tok = np.zeros(n, dtype=np.int64)
        for g in mb.groups:
            c = len(g.ranks)
            for s in g.samples:
                load[g.ranks[0]:g.ranks[-1] + 1] += workload.cost(lengths[s], c)
                tok[g.ranks[0]:g.ranks[-1] + 1] += tokens_per_rank(lengths[s], c)
                ideal_total += workload.cost(lengths[s], c) * c
        makespan += float(load.max())
        per_mb.append({"max": float(load.max()), "mean": float(load.mean())})
        peak_tokens = max(peak_tokens, int(tok.max()))
    ideal = ideal_total / n
    return {
        "micro_batches": len(plan.micro_batches),
        "makespan": makespan,
        "ideal": ideal,
        "efficiency": ideal / makespan if makespan else 1.0,
        "per_micro_batch": per_mb,
        "idle_rank_slots": sum(len(mb.idle_ranks) for mb in plan.micro_batches),
        "peak_tokens_per_rank": peak_tokens,
        "cap": cap,
    }
