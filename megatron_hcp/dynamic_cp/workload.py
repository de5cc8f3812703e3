"""What one sequence costs a rank of its CP group: training FLOPs and tokens held.

A sequence of length ``L`` split over a CP group of ``c`` ranks in the CP partition layout
(``cp_partition_mode``; zigzag pads to a multiple of ``2c``, contiguous to a multiple of ``c``)
gives every rank ``padded(L)/c`` tokens. Per rank and per training step (forward + backward =
3x forward):

* linear layers: ``L/c`` tokens through the QKV, output and MLP projections;
* attention: ``L**2 / c`` score entries (QK^T and PV), halved when causal, times the layout's
  :func:`partition_load`: the group's slowest rank carries that much more than the mean (1.0 for
  zigzag's balanced chunks, up to ``(2c-1)/c`` for contiguous slices of a causal sequence).
  In the contiguous layout the last rank of a group is the slowest for every sequence whose
  slices are whole, so summing these per-sequence costs prices a packed group's slowest rank
  (never below it); :meth:`GPTWorkload.rank_costs` gives every rank its own share.

``seq_squared`` reproduces megatron-core's own model (``L**2 / c``, no linear term), for
comparisons with its scheduler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from ..sharding import DEFAULT_CP_PARTITION_MODE, check_partition_mode, layout_unit

__all__ = ["GPTWorkload", "ScheduleError", "causal_pairs", "min_group_size", "partition_load",
           "partition_shares", "tokens_per_rank"]


class ScheduleError(ValueError):
    """An input no legal schedule exists for (named, with the rule and the fix)."""


def tokens_per_rank(length: int, group_size: int,
                    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> int:
    """Tokens one rank holds for a sequence of ``length`` on ``group_size`` ranks, padded as the
    layout cuts it (:func:`~megatron_hcp.sharding.layout_unit`)."""
    unit = layout_unit(group_size, cp_partition_mode)
    return -(-length // unit) * unit // group_size


def min_group_size(length: int, cap: int, world: int, min_size: int = 1,
                   cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE) -> int:
    """Smallest power-of-two group (>= ``min_size``) whose ranks hold <= ``cap`` tokens each."""
    if cap <= 0:
        raise ScheduleError(f"max_seqlen_per_dp_cp_rank={cap} must be > 0")
    size = max(1, min_size)
    while size <= world:
        if tokens_per_rank(length, size, cp_partition_mode) <= cap:
            return size
        size *= 2
    held = tokens_per_rank(length, world, cp_partition_mode)
    if -(-length // world) <= cap:  # enough ranks for the tokens: padding is the cause
        sizes = [1 << i for i in range(world.bit_length()) if 1 << i >= max(1, min_size)]
        least = min(tokens_per_rank(length, c, cp_partition_mode) for c in sizes or [world])
        raise ScheduleError(
            f"a sequence of {length} tokens, padded as the {cp_partition_mode} layout cuts it "
            f"(a multiple of {'twice ' if cp_partition_mode == 'zigzag' else ''}the group "
            f"size), "
            f"holds at least {least} tokens per rank on any group of up to {world} ranks, over "
            f"max_seqlen_per_dp_cp_rank={cap}: the padding, not the number of ranks, is the "
            f"cause; raise the cap to >= {least}")
    raise ScheduleError(
        f"a sequence of {length} tokens needs more than {world} ranks at "
        f"max_seqlen_per_dp_cp_rank={cap} (it would hold {held} per "
        f"rank on all {world}); raise the cap or drop/split the sequence"
    )


def causal_pairs(start: int, stop: int, window: int | None = None) -> int:
    """Score entries of the queries at positions ``start .. stop-1`` of a causal sequence: query
    ``i`` sees ``min(i, window) + 1`` keys (``window``: a sliding window of that many tokens
    back; None: unbounded)."""
    def upto(n: int) -> int:  # entries of the queries 0 .. n-1
        if window is None or n <= window + 1:
            return n * (n + 1) // 2
        w = window + 1
        return w * (w + 1) // 2 + (n - w) * w

    return upto(stop) - upto(start)


@functools.lru_cache(maxsize=1 << 16)  # pure; the scheduler asks per (length, group size)
def partition_shares(length: int, cp: int, mode: str = "zigzag", window: int | None = None,
                     a2a_size: int = 1) -> tuple[float, ...]:
    """Every rank's causal attention entries over the mean rank's, for one sequence cut over
    ``cp`` ranks in a CP partition layout (``cp_partition_mode``) exactly as
    :mod:`megatron_hcp.sharding` cuts it: ``layout_unit`` pieces of ``ceil(L / unit)`` tokens,
    zigzag rank r holding pieces r and 2cp-1-r, contiguous rank r piece r; padding does no
    work. ``a2a_size``: consecutive blocks of that many ranks pool their pieces and split the
    heads (hierarchical CP's a2a level), so each carries its block's mean."""
    check_partition_mode(mode)
    if cp <= 1 or length <= 0:
        return (1.0,) * max(1, cp)
    unit = layout_unit(cp, mode)
    u = -(-length // unit)
    pieces = [(r, unit - 1 - r) if mode == "zigzag" else (r,) for r in range(cp)]
    work = [sum(causal_pairs(min(k * u, length), min((k + 1) * u, length), window) for k in p)
            for p in pieces]
    a = max(1, a2a_size)
    work = [sum(work[r - r % a:r - r % a + a]) / a for r in range(cp)]
    mean = sum(work) / cp
    return tuple(w / mean for w in work)


def partition_load(length: int, cp: int, mode: str = "zigzag", window: int | None = None
                   ) -> float:
    """Max over mean of the ranks' causal attention entries (:func:`partition_shares`): zigzag
    (chunks r and 2cp-1-r) balances them (1.0, its padding ignored); contiguous (slice r) gives
    the last rank up to ``(2cp-1)/cp`` of the mean without a window, about 1.0 with a window
    shorter than a slice. The critical path of a CP group's attention is the mean work times
    this."""
    if cp <= 1 or length <= 0 or (mode == "zigzag" and window is None):
        check_partition_mode(mode)
        return 1.0  # zigzag's chunks balance causal work (up to padding)
    return max(partition_shares(length, cp, mode, window))


@dataclass(frozen=True)
class GPTWorkload:
    """Per-rank training cost of a GPT sequence; ``mode`` ``flops`` or ``seq_squared``."""

    num_layers: int = 1
    hidden_size: int = 4096
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 32
    num_query_groups: int | None = None
    gated_mlp: bool = False
    causal: bool = True
    mode: Literal["flops", "seq_squared"] = "flops"
    #: head dimension when it is not hidden / heads (megatron's ``kv_channels``)
    kv_channels: int | None = None
    #: a causal sliding window of this many tokens back (megatron's ``window_size[0]``)
    window: int | None = None
    #: the CP partition layout the groups cut sequences in (``cp_partition_mode``)
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE

    def __post_init__(self) -> None:
        check_partition_mode(self.cp_partition_mode)

    @staticmethod
    def causal_window(window_size: tuple[int, int] | list[int] | None) -> int | None:
        """The ``window`` of megatron's ``window_size=(left, right)``: ``left`` when it bounds
        the look-back (>= 0), else None (unbounded)."""
        if window_size is None or int(window_size[0]) < 0:
            return None
        return int(window_size[0])

    @property
    def balanced(self) -> bool:
        """Whether every rank of a CP group does the same attention work (then a sequence's
        cost splits exactly: ``cost(L, c) == cost(L, 1) / c``)."""
        return not self.causal or (self.cp_partition_mode == "zigzag"
                                   and (self.window is None or self.mode == "seq_squared"))

    def attention_shares(self, length: int, group_size: int, a2a_size: int = 1
                         ) -> tuple[float, ...]:
        """Each rank's attention over the mean rank's (:func:`partition_shares`; all 1.0 when
        the layout balances the ranks)."""
        if self.balanced or group_size <= 1:
            return (1.0,) * max(1, group_size)
        window = self.window if self.mode == "flops" else None
        return partition_shares(length, group_size, self.cp_partition_mode, window, a2a_size)

    def attention_load(self, length: int, group_size: int, a2a_size: int = 1) -> float:
        """The slowest rank's attention over the mean rank's."""
        return max(self.attention_shares(length, group_size, a2a_size))

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_width(self) -> int:
        """Width of the query / attention output (``hidden`` unless ``kv_channels`` is set)."""
        if self.kv_channels is None:
            return self.hidden_size
        return self.num_attention_heads * self.kv_channels

    def linear_flops_per_token(self) -> float:
        h = self.hidden_size
        kv = (self.num_query_groups or self.num_attention_heads) * self.head_dim
        q = self.query_width
        ffn = self.ffn_hidden_size or 4 * h
        qkv, proj = 2 * h * (q + 2 * kv), 2 * q * h
        mlp = 2 * (3 if self.gated_mlp else 2) * h * ffn
        return 3.0 * self.num_layers * (qkv + proj + mlp)

    def attention_flops(self, length: int) -> float:
        full = 4.0 * length * length * self.query_width  # QK^T and PV
        if self.window is not None and self.causal and self.window + 1 < length:
            entries = causal_pairs(0, length, self.window)  # a band, not a triangle
            return 3.0 * self.num_layers * 4.0 * entries * self.query_width
        return 3.0 * self.num_layers * (full / 2 if self.causal else full)

    def logits_flops_per_token(self, vocab_size: int) -> float:
        """Output layer (``hidden x vocab`` GEMM), forward + backward: ``3 * 2 * h * V``."""
        return 3.0 * 2 * self.hidden_size * vocab_size

    def _parts(self, length: int) -> tuple[float, float]:
        """(linear, attention) cost of the whole sequence on one rank."""
        if self.mode == "seq_squared":
            return 0, length * length
        return length * self.linear_flops_per_token(), self.attention_flops(length)

    def cost(self, length: int, group_size: int, a2a_size: int = 1) -> float:
        """Cost of ``length`` on ``group_size`` ranks (FLOPs, or L**2/c) for the group's slowest
        rank; the mean rank's is ``cost(length, 1) / group_size``. ``a2a_size``: hierarchical
        CP's a2a level (its ranks split heads, so the layout's imbalance is over the ring)."""
        linear, attention = self._parts(length)
        attention *= self.attention_load(length, group_size, a2a_size)
        return (linear + attention) / group_size

    def rank_costs(self, length: int, group_size: int, a2a_size: int = 1) -> list[float]:
        """Every rank's cost of ``length`` on ``group_size`` ranks, in group order."""
        linear, attention = self._parts(length)
        return [(linear + attention * share) / group_size
                for share in self.attention_shares(length, group_size, a2a_size)]
