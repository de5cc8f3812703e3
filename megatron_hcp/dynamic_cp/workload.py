"""What one sequence costs a rank of its CP group: training FLOPs and tokens held.

A sequence of length ``L`` split over a CP group of ``c`` ranks (load-balanced, padded to a
multiple of ``2c``) gives every rank ``padded(L)/c`` tokens. Per rank and per training step
(forward + backward = 3x forward):

* linear layers: ``L/c`` tokens through the QKV, output and MLP projections;
* attention: ``L**2 / c`` score entries (QK^T and PV), halved when causal.

``seq_squared`` reproduces megatron-core's own model (``L**2 / c``, no linear term), for
comparisons with its scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GPTWorkload", "ScheduleError", "causal_pairs", "min_group_size", "partition_load",
           "tokens_per_rank"]


class ScheduleError(ValueError):
    """An input no legal schedule exists for (named, with the rule and the fix)."""


def tokens_per_rank(length: int, group_size: int) -> int:
    """Tokens one rank holds for a sequence of ``length`` on ``group_size`` ranks (padded)."""
    unit = 2 * group_size
    return -(-length // unit) * unit // group_size


def min_group_size(length: int, cap: int, world: int, min_size: int = 1) -> int:
    """Smallest power-of-two group (>= ``min_size``) whose ranks hold <= ``cap`` tokens each."""
    if cap <= 0:
        raise ScheduleError(f"max_seqlen_per_dp_cp_rank={cap} must be > 0")
    size = max(1, min_size)
    while size <= world:
        if tokens_per_rank(length, size) <= cap:
            return size
        size *= 2
    raise ScheduleError(
        f"a sequence of {length} tokens needs more than {world} ranks at "
        f"max_seqlen_per_dp_cp_rank={cap} (it would hold {tokens_per_rank(length, world)} per "
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


def partition_load(length: int, cp: int, mode: str = "zigzag", window: int | None = None
                   ) -> float:
    """Max over mean of the causal attention entries of the ``cp`` ranks of one sequence in a
    CP partition layout (``cp_partition_mode``): zigzag (chunks r and 2cp-1-r) balances them
    (1.0); contiguous (slice r) gives the last rank up to ``(2cp-1)/cp`` of the mean without a
    window, about 1.0 with a window shorter than a slice. The critical path of a CP group's
    attention is the mean work times this."""
    if cp <= 1 or length <= 0 or (mode == "zigzag" and window is None):
        return 1.0  # zigzag's chunks balance causal work exactly
    if mode == "zigzag":
        u = length / (2 * cp)
        spans = [[(r * u, (r + 1) * u), ((2 * cp - 1 - r) * u, (2 * cp - r) * u)]
                 for r in range(cp)]
    elif mode == "contiguous":
        s = length / cp
        spans = [[(r * s, (r + 1) * s)] for r in range(cp)]
    else:
        raise ValueError(f"cp_partition_mode={mode!r}: use zigzag or contiguous")
    work = [sum(causal_pairs(round(a), round(b), window) for a, b in rank) for rank in spans]
    mean = sum(work) / cp
    return max(work) / mean if mean else 1.0


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

    def cost(self, length: int, group_size: int) -> float:
        """Per-rank cost of ``length`` on ``group_size`` ranks (FLOPs, or L**2/c)."""
        if self.mode == "seq_squared":
            return length * length / group_size
        return (length * self.linear_flops_per_token() + self.attention_flops(length)) / (
            group_size
        )
