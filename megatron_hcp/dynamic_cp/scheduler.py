"""Dynamic-CP scheduler: sequences of a global batch -> micro-batches of aligned CP groups.

Every micro-batch partitions the ``N`` DPxCP ranks into contiguous, aligned power-of-two blocks
(the dynamic CP groups); each block runs some sequences, each split over the whole block. A
micro-batch ends in a barrier, so a step costs the sum over micro-batches of the slowest rank.

Algorithm (deterministic; no hashing, no randomness):

1. every sequence gets its smallest legal group: the smallest power of two (>= ``min_cp_size``)
   whose ranks hold at most ``cap`` tokens (:func:`~.workload.min_group_size`);
2. for a target count ``M`` (from the token-capacity bound upwards), micro-batches are built
   one at a time at the level ``work left / (N * micro-batches left)`` per rank:

   a. *cover*: the heaviest sequences left (per rank, at their smallest group) each get a block
      until the N ranks are used up; a sequence heavier than the level by more than the spread
      rule's slack is spread over a larger group first; blocks are allotted largest first, so
      the aligned power-of-two blocks never fragment;
   b. *fill*: each block's gap up to the level (and its ranks' token room under the cap) takes
      the costliest sequence left that fits, repeatedly (sequences whose smallest group is at
      most the block's size; a bisection per size class);
   c. the last planned micro-batch tries a few levels above the even share and keeps the
      cheapest complete tail;
   d. ranks left without a sequence (only when the batch runs out) get work: the groups of the
      smallest aligned block around an idle rank merge into one group over the block (cap
      permitting); ranks stay idle, and are reported, only when no such merge exists;
   e. FLOPs mode: while the micro-batch's slowest rank exceeds its mean by more than 2 %, its
      slowest groups merge with the rest of an aligned block around them (the smallest block
      that lowers their per-rank cost within the cap): the leftovers of a batch rarely balance
      at their smallest groups (robustness over caps and model sizes; ``dynamic_cp.bounds``);

3. of the candidates (counts ``M``, three spread rules) the plan with the smallest makespan
   wins. The FLOPs model treats splitting a sequence over more ranks as free (whole-world groups
   would always look perfectly balanced) and a micro-batch as costless, so in FLOPs mode, among
   the plans within 1 % of the best makespan, the fewest micro-batches (fewer barriers, larger
   packs) and then the least splitting (token-weighted group size) win; given
   ``hardware``, the makespan is the projected step time including the exposed CP ring traffic
   (:mod:`.projection`), which prices splitting itself: a :class:`~.projection.Hardware` is one
   link for every group; a :class:`~.projection.Cluster` has two link classes (a group of ``c``
   aligned ranks lies inside a node iff ``c <= gpus_per_node``) and, with ``hcp_a2a_size=a``
   (dynamic hierarchical CP), prices each group as an a2a level of ``min(c, a)`` ranks plus a
   ring over ``c / min(c, a)``. With VPP the count is a multiple of
   ``k`` (padded with empty micro-batches, reported, only when no candidate reaches one).
"""

from __future__ import annotations

import functools
import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..config import (
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    CPConfigError,
    dynamic_levels,
    is_power_of_two,
    parse_int,
)
from ..sharding import layout_unit
from .projection import Cluster, Hardware, group_pricer
from .workload import GPTWorkload, ScheduleError, min_group_size, tokens_per_rank

__all__ = ["SCHEDULE_MAX_DP_CP", "SCHEDULE_MAX_VPP", "Group", "MicroBatch", "Plan", "schedule"]

# spread rules tried: (slack over the level, capped at a token-full rank's cost)
_SPREAD_RULES = ((1.5, True), (2.0, False), (math.inf, True))
# FLOPs mode: among plans within this share of the best makespan, fewest micro-batches, then
# least splitting, win
_MAKESPAN_TOLERANCE = 0.01
_LAST_LEVEL_FACTORS = (1.0, 1.02, 1.05, 1.1, 1.2)
# a micro-batch's slowest rank may exceed its mean by this share before groups are spread
# further (``_Packer._equalize``): balance against splitting
_EQUALIZE_SLACK = 0.02
_EXTRA_MICRO_BATCHES = 4  # candidates above the token-capacity bound that are tried


class _Candidate(NamedTuple):
    pad: int  # empty micro-batches added for VPP
    score: float  # FLOPs makespan, or projected seconds
    splitting: float  # token-weighted group size
    mbs: list


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


# the DPxCP group one schedule plans: its cost grows with the ranks (an aligned-block sweep per
# micro-batch); measured with 65536 sequences: 16384 ranks 52 s, 131072 ranks 88-100 s
# (benchmarks/input_limits.py); the API and `megatron-hcp schedule` share it
SCHEDULE_MAX_DP_CP = 16384
SCHEDULE_MAX_VPP = 1024  # virtual pipeline stages (the CLI's --vpp bound)


def _read_inputs(lengths, dp_cp, max_seqlen_per_rank, min_cp_size, vpp
                 ) -> tuple[list[int], int, int, int, int]:
    """The inputs of :func:`schedule` by the project's one strict parser, within the bounds
    ``megatron-hcp schedule`` applies (nothing is coerced: 100.7, "200" and True are not
    lengths): at most MAX_SEQUENCES lengths of 1..MAX_SEQ_LENGTH tokens, DPxCP up to
    SCHEDULE_MAX_DP_CP, the cap up to MAX_SEQ_LENGTH, vpp up to SCHEDULE_MAX_VPP."""
    try:
        if not isinstance(lengths, Sequence) or isinstance(lengths, (str, bytes)):
            raise ScheduleError(f"lengths is a {type(lengths).__name__}: give a list of "
                                "sequence lengths (one global batch)")
        if len(lengths) > MAX_SEQUENCES:
            raise ScheduleError(f"lengths holds {len(lengths)} sequences, over the limit of "
                                f"{MAX_SEQUENCES} per global batch; give one global batch")
        # upper bounds here; the lower ones are _check_inputs' rules
        return ([parse_int(x, f"lengths[{i}]", maximum=MAX_SEQ_LENGTH, text=False)
                 for i, x in enumerate(lengths)],
                parse_int(dp_cp, "dp_cp", maximum=SCHEDULE_MAX_DP_CP, text=False),
                parse_int(max_seqlen_per_rank, "max_seqlen_per_rank", maximum=MAX_SEQ_LENGTH,
                          text=False),
                parse_int(min_cp_size, "min_cp_size", text=False),
                parse_int(vpp, "vpp", maximum=SCHEDULE_MAX_VPP, text=False))
    except CPConfigError as err:
        raise ScheduleError(str(err.violations[0])) from None


def _check_inputs(lengths, n, cap, min_cp_size, vpp) -> None:
    if not is_power_of_two(n):
        raise ScheduleError(
            f"dp_cp={n}: dynamic CP groups are aligned power-of-two blocks of the DPxCP ranks, "
            "so DPxCP must be a power of two; change the DP or CP size"
        )
    if cap <= 0:
        raise ScheduleError(f"max_seqlen_per_dp_cp_rank={cap} must be > 0")
    if not is_power_of_two(min_cp_size) or min_cp_size > n:
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


def _check_pricing(hardware, hcp_a2a_size, n: int, model: GPTWorkload) -> None:
    """Parameters of the hardware ranking: named, with the rule and the fix."""
    if hardware is not None and not isinstance(hardware, (Hardware, Cluster)):
        raise ScheduleError(f"hardware={hardware!r} must be a projection.Hardware (one link) or "
                            "a projection.Cluster (two link classes); pass one of them or None")
    if isinstance(hardware, Cluster):
        for name, minimum in (("gpus_per_node", 1), ("nodes", 1)):
            try:
                parse_int(getattr(hardware, name), f"hardware.{name}", minimum=minimum,
                          text=False)
            except CPConfigError as err:
                raise ScheduleError(str(err.violations[0])) from None
        for name in ("flops_per_second", "intra_bytes_per_second", "inter_bytes_per_second",
                     "intra_latency_seconds", "inter_latency_seconds"):
            value = getattr(hardware, name)
            rule = ">= 0" if "latency" in name else "> 0"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    value >= 0 if "latency" in name else value > 0):
                raise ScheduleError(f"hardware.{name}={value!r} must be a number {rule}; "
                                    f"give the Cluster a {name} {rule}")
    if hcp_a2a_size is None:
        return
    try:
        a = parse_int(hcp_a2a_size, "hcp_a2a_size", text=False)
    except CPConfigError as err:
        raise ScheduleError(str(err.violations[0])) from None
    if not isinstance(hardware, Cluster):
        raise ScheduleError(
            f"hcp_a2a_size={a} needs hardware=Cluster(...): hierarchical groups are priced "
            "with two link classes (the a2a level inside a node, the ring across); pass a "
            "Cluster, or drop hcp_a2a_size for flat dynamic CP")
    if a < 2 or not is_power_of_two(a) or a > n:
        raise ScheduleError(
            f"hcp_a2a_size={a} must be a power of two >= 2 and <= dp_cp={n} (the a2a level "
            "tiles the aligned power-of-two dynamic groups); use 2, 4, 8, ... <= dp_cp, or None "
            "for flat dynamic CP")
    kv = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % a or (kv % a and a % kv):
        raise ScheduleError(
            f"hcp_a2a_size={a}: the a2a level splits the {model.num_attention_heads} query "
            f"heads and the {kv} KV heads; it must divide the query heads and divide or be a "
            "multiple of the KV heads (then they are replicated, as CPConfig allows for the "
            "reference backend); use a smaller a2a size")


def _work_at(ids: list[int], work):
    """Position in ``ids`` -> ``work`` of the sequence there."""
    def value(j: int) -> float:
        return work(ids[j])
    return value


class _Pool:
    """Unplaced sequences by minimum group size; each class sorted by total cost, ascending.

    Also the covering walk's state: which sequences are placed, and the position in the
    covering order before which all are.
    """

    def __init__(self, total: Sequence[float], c0: Sequence[int]):
        self.total, self.c0 = total, c0
        self.cost: dict[int, list[float]] = {}
        self.ids: dict[int, list[int]] = {}
        for s in sorted(range(len(total)), key=lambda s: (total[s], s)):
            self.cost.setdefault(c0[s], []).append(total[s])
            self.ids.setdefault(c0[s], []).append(s)
        self.sizes = sorted(self.cost)
        self.count = len(total)
        self.placed = [False] * len(total)
        self.cover_from = 0

    def copy(self) -> _Pool:
        other = object.__new__(_Pool)
        other.__dict__.update(self.__dict__)
        other.cost = {c: list(v) for c, v in self.cost.items()}
        other.ids = {c: list(v) for c, v in self.ids.items()}
        other.placed = list(self.placed)
        return other

    def take_largest(self, max_size: int, limit: float, fits=None, work=None) -> int | None:
        """Remove the costliest sequence with min size <= ``max_size``, cost <= ``limit`` and
        ``fits(s)`` (the token cap: checked on the sequence itself, whatever the cost model).

        ``work(s)``: its cost where it would run, when that is not its total (a layout whose
        slowest rank carries more than the mean); it grows with the length as the total does,
        so each class stays sorted by it."""
        best_c, best_i, best = -1, -1, -1.0
        for c in self.sizes:
            if c > max_size:
                break
            costs, ids = self.cost[c], self.ids[c]
            if work is None:
                i = bisect_right(costs, limit) - 1
                value = costs.__getitem__
            else:
                value = _work_at(ids, work)
                i = bisect_right(range(len(ids)), limit, key=value) - 1
            while fits is not None and i >= 0 and value(i) > best and not fits(ids[i]):
                i -= 1
            if i >= 0 and value(i) > best:
                best_c, best_i, best = c, i, value(i)
        if best_c < 0:
            return None
        self.count -= 1
        self.cost[best_c].pop(best_i)
        s = self.ids[best_c].pop(best_i)
        self.placed[s] = True
        return s

    def remove(self, s: int) -> None:
        costs, ids = self.cost[self.c0[s]], self.ids[self.c0[s]]
        i = bisect_left(costs, self.total[s])
        while ids[i] != s:
            i += 1
        costs.pop(i)
        ids.pop(i)
        self.count -= 1
        self.placed[s] = True


@dataclass
class _Block:
    start: int
    size: int
    load: float  # per-rank cost
    tokens: int  # per-rank tokens
    samples: list[int]


class _Packer:
    """Builds micro-batches one at a time at a given per-rank cost level."""

    def __init__(self, lengths, n, cap, total, c0, model: GPTWorkload, rule, equalize=True,
                 hcp_a2a_size: int | None = None):
        self.lengths, self.n, self.cap, self.rule = lengths, n, cap, rule
        self.equalize = equalize  # spread slow groups further (FLOPs mode, see _equalize)
        self.length_array = np.asarray(lengths, dtype=np.int64)
        self.mode, self.balanced = model.cp_partition_mode, model.balanced
        self.total, self.c0 = total, c0
        # work(s, c): a sequence's cost on c ranks times c (its total when the layout balances
        # the ranks); length_work: the same for a length
        self.length_work = functools.cache(
            lambda length, c: model.cost(length, c, dynamic_levels(c, hcp_a2a_size)[0]) * c)
        if model.balanced:
            self.work = lambda s, c: total[s]
        else:
            self.work = lambda s, c: self.length_work(lengths[s], c)
        # covering order: heaviest per rank at the minimum group size first
        self.order = sorted(range(len(lengths)), key=lambda s: (-self.work(s, c0[s]) / c0[s], s))
        self.full_rank = self.length_work(cap, 1)

    def run(self, m: int, mb_score, budget: float = math.inf) -> tuple[list, float] | None:
        """Pack everything aiming at ``m`` micro-batches (more if the rest does not fit).

        Each micro-batch's level is the work left over the micro-batches left; the last one
        tries a few levels above that and keeps the cheapest complete tail. Returns the
        micro-batches and their summed ``mb_score``, or None as soon as that exceeds
        ``budget`` (the plan could not win).
        """
        pool = _Pool(self.total, self.c0)
        remaining = float(sum(self.total))
        out: list = []
        spent = 0.0
        while pool.count and m - len(out) > 1:
            groups, idle, peak, work = self._micro_batch(
                pool, remaining / (self.n * (m - len(out))))
            remaining -= work
            out.append((groups, idle, peak))
            spent += mb_score(groups, peak)
            if spent > budget:
                return None
        best = None
        for factor in _LAST_LEVEL_FACTORS if pool.count else ():
            tail = self._tail(pool.copy(), remaining, factor)
            cost = sum(mb_score(groups, peak) for groups, _, peak in tail)
            if best is None or cost < best[0]:
                best = (cost, tail)
            if len(tail) > 2:  # a long overflow: higher levels cannot make it one micro-batch
                break
        if best is None:
            return out, spent
        if spent + best[0] > budget:
            return None
        return out + best[1], spent + best[0]

    def _tail(self, pool: _Pool, remaining: float, factor: float) -> list:
        out = []
        while pool.count:
            groups, idle, peak, work = self._micro_batch(
                pool, remaining / self.n * (factor if not out else 1.0))
            remaining -= work
            out.append((groups, idle, peak))
        return out

    def _tokens(self, length: int, size: int) -> int:
        return tokens_per_rank(length, size, self.mode)

    def _fits(self, samples: list[int], size: int) -> bool:
        """The ranks of a group of ``size`` running ``samples`` hold at most ``cap`` tokens
        (:func:`~.workload.tokens_per_rank`, vectorized: padded as the layout cuts)."""
        if len(samples) < 16:
            return sum(self._tokens(self.lengths[s], size) for s in samples) <= self.cap
        unit = layout_unit(size, self.mode)
        held = -(-self.length_array[samples] // unit) * (unit // size)
        return int(held.sum()) <= self.cap

    def _micro_batch(self, pool: _Pool, level: float):
        n, total, c0, work_on = self.n, self.total, self.c0, self.work
        # a sequence heavier than the level is spread over more ranks only when it exceeds the
        # level by the rule's slack (capped: or what a rank full of tokens costs - ranks bound
        # by the cap could not catch up with it)
        slack, capped = self.rule
        spread_above = level * slack
        if capped:
            spread_above = min(spread_above, max(level, self.full_rank))
        free, cover, order = n, [], self.order
        placed = pool.placed
        while pool.cover_from < len(order) and placed[order[pool.cover_from]]:
            pool.cover_from += 1
        for i in range(pool.cover_from, len(order)):  # 1. cover with the heaviest left
            s = order[i]
            if placed[s]:
                continue
            c = c0[s]
            while c < n and work_on(s, c) / c > spread_above:
                c *= 2  # heavier than the level: spread it over more ranks
            if c <= free:
                cover.append((c, s))
                free -= c
                if not free:
                    break
        blocks, start = [], 0
        for c, s in sorted(cover, key=lambda x: (-x[0], x[1])):  # buddy order: no fragments
            pool.remove(s)
            blocks.append(_Block(start, c, work_on(s, c) / c, self._tokens(self.lengths[s], c),
                                 [s]))
            start += c
        level = max([level] + [b.load for b in blocks])
        # 2. fill every block's gap with the costliest sequence that still fits (cost, cap)
        for b in sorted(blocks, key=lambda b: (-(level - b.load) * b.size, b.start)):
            while pool.count:
                room = self.cap - b.tokens
                longest = (room // 2) * 2 * b.size
                if longest < 1:
                    break
                limit = min((level - b.load) * b.size * (1 + 1e-12),
                            self.length_work(longest, b.size))
                s = pool.take_largest(
                    b.size, limit,
                    lambda s, b=b, room=room: self._tokens(self.lengths[s], b.size) <= room,
                    None if self.balanced else (lambda s, b=b: work_on(s, b.size)))
                if s is None:
                    break
                b.samples.append(s)
                b.load += work_on(s, b.size) / b.size
                b.tokens += self._tokens(self.lengths[s], b.size)
        work = sum(total[s] for b in blocks for s in b.samples)
        groups = {(b.start, b.size): b.samples for b in blocks}
        idle = _absorb_idle(groups, n, self._fits) if free else ()
        if self.equalize:
            groups = self._equalize(groups, work)
        return groups, idle, self._peak(groups), work

    def _peak(self, groups: dict) -> float:
        return max(sum(self.work(s, size) for s in samples) / size
                   for (_, size), samples in groups.items())

    def _equalize(self, groups: dict, work: float) -> dict:
        """Spread the slowest groups over larger aligned blocks while that helps (FLOPs mode).

        The leftovers of a batch rarely balance at their smallest groups; a group merged with
        the rest of an aligned block around it carries the same work over more ranks, at the
        block's average per-rank cost (never above its slowest member). Heaviest group first,
        the smallest block that lowers its per-rank cost and fits the cap is taken; until the
        slowest rank is within :data:`_EQUALIZE_SLACK` of the mean or no group can be helped.
        """
        n, lengths = self.n, self.lengths
        target = work / n * (1 + _EQUALIZE_SLACK)
        # per group: work (on its ranks), summed length, sequence count
        stats = {k: (sum(self.work(s, k[1]) for s in v), sum(lengths[s] for s in v), len(v))
                 for k, v in groups.items()}
        heap = [(-w / k[1], k) for k, (w, _, _) in stats.items() if w / k[1] > target]
        if not heap:
            return groups
        owner: list = [None] * n
        for k in groups:
            owner[k[0]:k[0] + k[1]] = [k] * k[1]
        heapq.heapify(heap)
        while heap:
            _, key = heapq.heappop(heap)
            if key not in groups:
                continue  # merged into a block already
            merged = self._merge_up(groups, stats, owner, key)
            if merged is not None and stats[merged][0] / merged[1] > target:
                heapq.heappush(heap, (-stats[merged][0] / merged[1], merged))
        return groups

    def _merge_up(self, groups: dict, stats: dict, owner: list, key: tuple) -> tuple | None:
        """Merge group ``key`` into the smallest aligned block around it that lowers its
        per-rank cost within the cap (``_equalize``), in place; the merged key, or None."""
        start, size = key
        own = stats[key][0] / size
        block = 2 * size
        while block <= self.n:
            first = start - start % block
            members = list(dict.fromkeys(k for k in owner[first:first + block] if k is not None))
            samples = [s for k in members for s in groups[k]]
            if self.balanced:
                work = sum(stats[k][0] for k in members)
            else:  # a layout whose slowest rank's share depends on the group size
                work = sum(self.work(s, block) for s in samples)
            if work / block < own * (1 - 1e-12):
                raw = sum(stats[k][1] for k in members)
                count = sum(stats[k][2] for k in members)
                # tokens_per_rank(L, b) <= L / b + 2: the exact sum only when that bound fails
                if raw / block + 2 * count <= self.cap or self._fits(samples, block):
                    merged = (first, block)
                    for k in members:
                        del groups[k], stats[k]
                    groups[merged], stats[merged] = samples, (work, raw, count)
                    owner[first:first + block] = [merged] * block
                    return merged
            block *= 2
        return None


def _absorb_idle(groups: dict, n: int, fits=None) -> tuple[int, ...]:
    """Give idle ranks work; returns the ranks that stay idle (no legal merge exists).

    Bottom-up over aligned blocks (size 2, 4, ... N): a block with idle ranks and some groups
    becomes one group over the whole block holding all their sequences (split over more ranks:
    the per-rank load never rises). ``fits(samples, size)`` vetoes merges that would break the
    token cap.
    """
    owner: list = [None] * n
    for key in groups:
        start, size = key
        owner[start:start + size] = [key] * size
    size = 2
    while size <= n:
        for start in range(0, n, size):
            block = owner[start:start + size]
            if None not in block:
                continue
            keys = list(dict.fromkeys(k for k in block if k is not None))
            samples = [s for k in keys for s in groups[k]]
            if keys and (fits is None or fits(samples, size)):
                for k in keys:
                    del groups[k]
                groups[(start, size)] = samples
                owner[start:start + size] = [(start, size)] * size
        size *= 2
    return tuple(r for r in range(n) if owner[r] is None)


def schedule(
    lengths: Sequence[int],
    dp_cp: int,
    max_seqlen_per_rank: int,
    *,
    workload: GPTWorkload | None = None,
    min_cp_size: int = 1,
    vpp: int = 1,
    hardware: Hardware | Cluster | None = None,
    hcp_a2a_size: int | None = None,
) -> Plan:
    """Schedule the global batch ``lengths`` (sample id = position) on ``dp_cp`` ranks.

    ``hardware`` (optional): rank candidate plans by projected seconds (compute plus exposed
    CP traffic) instead of FLOPs makespan; needs ``workload.mode == "flops"``. A
    :class:`~.projection.Hardware` prices every group as a flat ring on one link; a
    :class:`~.projection.Cluster` prices each group on the links its ranks need (inside a node
    / across nodes). ``hcp_a2a_size`` (needs a Cluster): the a2a level of dynamic hierarchical
    CP (``hierarchical_context_parallel_sizes[0]``); a group of ``c`` ranks is then priced as
    a2a over ``min(c, a)`` plus a ring over ``c / min(c, a)``. None: flat dynamic CP.
    """
    lengths, n, cap, min_cp_size, vpp = _read_inputs(lengths, dp_cp, max_seqlen_per_rank,
                                                     min_cp_size, vpp)
    _check_inputs(lengths, n, cap, min_cp_size, vpp)
    model = workload or GPTWorkload()
    if hardware is not None and model.mode != "flops":
        raise ScheduleError(f"hardware= needs the flops cost model, not mode={model.mode!r}")
    _check_pricing(hardware, hcp_a2a_size, n, model)
    mode = model.cp_partition_mode
    c0 = [min_group_size(length, cap, n, min_cp_size, mode) for length in lengths]
    total = [model.cost(length, 1) for length in lengths]  # the mean rank's: total / c

    price = group_pricer(model, hardware, hcp_a2a_size) if hardware is not None else None

    def mb_score(groups: dict, peak: float) -> float:
        if price is None:
            return peak
        return max((sum(price(lengths[s], start, size) for s in v)
                    for (start, size), v in groups.items()), default=0.0)

    # lower bound on the micro-batch count: token capacity of N ranks
    m_lo = max(1, math.ceil(sum(tokens_per_rank(x, c, mode) * c for x, c in zip(lengths, c0))
                            / (n * cap)))
    counts = sorted({-(-m // vpp) * vpp for m in range(m_lo, m_lo + _EXTRA_MICRO_BATCHES + 1)})
    # hardware mode prices splitting itself: only float-rounding ties go to the tie-break
    tolerance = 1e-9 if hardware else _MAKESPAN_TOLERANCE
    candidates, budget = [], math.inf  # budget: what a plan may score and still be chosen
    for rule in _SPREAD_RULES:
        # equalizing is FLOPs mode's: given hardware it cost 4x the scheduling time at N=256
        # (0.25 -> 1.07 s) for projected steps within 1 % (benchmarks/RESULTS.md, Table 3)
        packer = _Packer(lengths, n, cap, total, c0, model, rule, equalize=price is None,
                         hcp_a2a_size=hcp_a2a_size)
        for m in counts:
            result = packer.run(m, mb_score, budget)
            if result is None:
                continue
            mbs, score = result
            pad = -len(mbs) % vpp
            splitting = sum(lengths[s] * size for groups, _, _ in mbs
                            for (_, size), v in groups.items() for s in v)
            candidates.append(_Candidate(pad, score, splitting, mbs))
            if not pad:
                budget = min(budget, score * (1 + tolerance))
    fewest_pads = min(c.pad > 0 for c in candidates)
    candidates = [c for c in candidates if (c.pad > 0) == fewest_pads]
    bound = min(c.score for c in candidates) * (1 + tolerance)
    best = min((c for c in candidates if c.score <= bound),
               key=lambda c: (len(c.mbs) + c.pad, c.splitting, c.score))
    mbs, pad = best.mbs, best.pad
    mbs = mbs + [({}, tuple(range(n)), 0.0)] * pad  # fewer sequences than VPP needs
    notes, micro_batches = [], []
    for j, (groups, idle, _) in enumerate(mbs):
        if idle:
            notes.append(
                f"micro-batch {j}: ranks {list(idle)} idle: no sequence can be placed there "
                f"(the batch has {len(lengths)} sequences for {len(mbs)} micro-batches of {n} "
                "ranks)"
            )
        micro_batches.append(MicroBatch(
            tuple(Group(tuple(range(st, st + sz)), tuple(sorted(v)))
                  for (st, sz), v in sorted(groups.items())), tuple(idle)))
    plan = Plan(tuple(micro_batches), tuple(notes))
    _verify_plan(plan, lengths, n, cap, mode)
    object.__setattr__(plan, "summary", summarize(plan, lengths, n, cap, model, min_cp_size,
                                                  hcp_a2a_size))
    return plan


def _verify_plan(plan: Plan, lengths: Sequence[int], n: int, cap: int,
                 cp_partition_mode: str = "zigzag") -> None:
    """Final check of every plan, whatever built it: each sample exactly once, groups inside
    the ``n`` ranks, and no rank above the token cap."""
    seen: list[int] = []
    for j, mb in enumerate(plan.micro_batches):
        for group in mb.groups:
            size = len(group.ranks)
            tokens = sum(tokens_per_rank(lengths[s], size, cp_partition_mode)
                         for s in group.samples)
            if tokens > cap:
                raise ScheduleError(
                    f"internal scheduler error: micro-batch {j} puts {tokens} tokens on each "
                    f"rank of group {list(group.ranks)} (samples {list(group.samples)}), above "
                    f"max_seqlen_per_dp_cp_rank={cap}; please report it with the lengths")
            if group.ranks and (group.ranks[0] < 0 or group.ranks[-1] >= n):
                raise ScheduleError(f"internal scheduler error: group {list(group.ranks)} of "
                                    f"micro-batch {j} is outside the {n} ranks")
            seen.extend(group.samples)
    if sorted(seen) != list(range(len(lengths))):
        raise ScheduleError("internal scheduler error: the plan does not place every sample "
                            "exactly once; please report it with the lengths")


def summarize(plan: Plan, lengths: Sequence[int], n: int, cap: int,
              workload: GPTWorkload, min_cp_size: int = 1,
              hcp_a2a_size: int | None = None) -> dict:
    """Makespan, efficiency (ideal / makespan), per-micro-batch max/mean, idle slots, tokens.

    Every rank is charged its own share of each sequence it holds (``workload.rank_costs``:
    the layout's imbalance included); ``mean`` and ``ideal`` are the work over the ranks.
    ``hcp_a2a_size``: the a2a level of dynamic hierarchical CP (its ranks split heads).
    ``enlarged_token_fraction``: share of all tokens whose sequence runs on a larger group than
    the smallest legal one (more CP communication than needed); ``mean_group_size`` /
    ``mean_min_group_size``: token-weighted group size chosen / smallest legal.
    """
    mode = workload.cp_partition_mode
    ideal_total = 0.0
    makespan = 0.0
    per_mb = []
    peak_tokens = 0
    enlarged = weighted = weighted_min = 0
    for mb in plan.micro_batches:
        load = np.zeros(n)
        tok = np.zeros(n, dtype=np.int64)
        work = 0.0
        for g in mb.groups:
            c = len(g.ranks)
            for s in g.samples:
                least = min_group_size(lengths[s], cap, n, min_cp_size, mode)
                enlarged += lengths[s] if c > least else 0
                weighted += lengths[s] * c
                weighted_min += lengths[s] * least
                load[g.ranks[0]:g.ranks[-1] + 1] += workload.rank_costs(
                    lengths[s], c, dynamic_levels(c, hcp_a2a_size)[0])
                tok[g.ranks[0]:g.ranks[-1] + 1] += tokens_per_rank(lengths[s], c, mode)
                work += workload.cost(lengths[s], 1)
        ideal_total += work
        makespan += float(load.max())
        per_mb.append({"max": float(load.max()), "mean": work / n})
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
        "enlarged_token_fraction": enlarged / max(1, sum(lengths)),
        "mean_group_size": weighted / max(1, sum(lengths)),
        "mean_min_group_size": weighted_min / max(1, sum(lengths)),
    }
