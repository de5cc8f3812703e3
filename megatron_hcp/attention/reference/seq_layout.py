"""Where the tokens of a CP position sit inside the attention kernels (:class:`SeqLayout`), the
validation of packed-sequence metadata, and the a2a re-ordering; which tokens a rank holds is
:mod:`megatron_hcp.sharding`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from ...sharding import (
    DEFAULT_CP_PARTITION_MODE,
    ShardingError,
    check_partition_mode,
    cu_seqlens_values,
    layout_unit,
    seq_lengths,
)

__all__ = ["CPAttentionError", "SeqLayout", "a2a_gather_permutation", "check_cu_seqlens",
           "half_grouping"]

# bad input to CP attention, raised before any collective starts: the sharding error (one class,
# so callers catch attention and sharding input errors alike)
CPAttentionError = ShardingError


def check_cu_seqlens(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, name: str = "q",
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> None:
    """Validate packed-sequence metadata; raise :class:`CPAttentionError` naming the problem."""
    for label, cu in ((f"cu_seqlens_{name}", cu_seqlens),
                      (f"cu_seqlens_{name}_padded", cu_seqlens_padded)):
        if len(cu_seqlens_values(cu, label)) < 2:
            raise CPAttentionError(f"{label} holds one entry: must describe at least one "
                                   "sequence ([0, length, ...])")
    if cu_seqlens.numel() != cu_seqlens_padded.numel():
        raise CPAttentionError(
            f"cu_seqlens_{name} and cu_seqlens_{name}_padded describe a different number of "
            "sequences"
        )
    real, padded = seq_lengths(cu_seqlens), seq_lengths(cu_seqlens_padded)
    unit = layout_unit(cp_size, cp_partition_mode)
    rule = "2*cp_size" if cp_partition_mode == "zigzag" else "cp_size"
    for i, (n, p) in enumerate(zip(real, padded)):
        if p < n:
            raise CPAttentionError(
                f"sequence {i}: padded length {p} < real length {n} in cu_seqlens_{name}_padded"
            )
        if p % unit:
            raise CPAttentionError(
                f"sequence {i}: padded length {p} is not a multiple of {rule}={unit}; in the "
                f"{cp_partition_mode} layout every packed sequence must be padded to a multiple "
                f"of {rule} (nothing is truncated silently). Pad with "
                "megatron_hcp.sharding.pad_thd (same cp_partition_mode) and pass its cu_seqlens "
                f"as cu_seqlens_{name}_padded"
            )


@lru_cache(maxsize=256)
def _layout_meta(padded: tuple[int, ...], real: tuple[int, ...], cp: int, position: int,
                 mode: str, grouped: bool = False) -> tuple[torch.Tensor, ...]:
    """Per-token sequence id, position, validity and the two halves' token indices (the
    contiguous layout has one piece per sequence: all of it is the "first half"); ``grouped``:
    the tokens in :func:`half_grouping` order (every first half, then every second half)."""
    seq_ids, positions, first, second = [], [], [], []
    offset = 0
    unit = layout_unit(cp, mode)
    pieces = ((position, first), (2 * cp - 1 - position, second)) if mode == "zigzag" else (
        (position, first),)
    for i, p in enumerate(padded):
        c = p // unit
        for chunk, bucket in pieces:
            pos = torch.arange(chunk * c, (chunk + 1) * c)
            positions.append(pos)
            seq_ids.append(torch.full((c,), i))
            bucket.append(torch.arange(offset, offset + c))
            offset += c

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)

    seq_id, pos = cat(seq_ids), cat(positions)
    length = torch.tensor(real)[seq_id] if len(seq_id) else seq_id
    first, second = cat(first), cat(second)
    if grouped:  # the same tokens, first halves then second halves: halves are slices
        order = torch.cat([first, second])
        seq_id, pos = seq_id[order], pos[order]
        length = length[order] if len(length) else length
        first, second = torch.arange(len(first)), torch.arange(len(first), len(order))
    return seq_id, pos, pos < length, first, second


def half_grouping(padded: tuple[int, ...], cp: int) -> torch.Tensor:
    """The local token order of packed zigzag sequences with the halves grouped: the first
    half of every sequence, then the second half of every sequence (indices into the usual
    order: sequence by sequence, each its first then its second half). The same on every CP
    position (each holds ``padded[i] / (2 cp)`` tokens of each half of sequence ``i``), so K/V
    that travel between positions keep it."""
    first, second, offset = [], [], 0
    for p in padded:
        c = p // (2 * cp)
        first.append(torch.arange(offset, offset + c))
        second.append(torch.arange(offset + c, offset + 2 * c))
        offset += 2 * c
    parts = first + second
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@lru_cache(maxsize=64)  # a packing needs cp entries a rank; packings change every micro-batch
def _layout_meta_on(padded: tuple[int, ...], real: tuple[int, ...], cp: int, position: int,
                    mode: str, device: str, grouped: bool) -> tuple[torch.Tensor, ...]:
    """:func:`_layout_meta` on ``device``, moved there once per layout (every block of every
    layer, forward and backward, reads it: no copy to the device per block)."""
    meta = _layout_meta(padded, real, cp, position, mode, grouped)
    return meta if device == "cpu" else tuple(t.to(device) for t in meta)


@dataclass(frozen=True)
class SeqLayout:
    """Where the tokens of one CP position sit (``thd``: per sequence; else one sequence).

    ``padded[i]`` / ``real[i]``: padded and real length of sequence i; ``cp``/``position``:
    the chunking and which CP position this layout describes; ``mode``: the partition layout;
    ``device``: where its per-token metadata (and the masks and indices built from it) live -
    the device of the attention's tensors; ``grouped``: packed zigzag tokens in
    :func:`half_grouping` order, so that each half is a slice (the attention's own order:
    blocks take slices, not gathered rows).
    Zigzag (``2*cp`` chunks): local tokens of sequence i are its first half (chunk
    ``position``) then its second half (chunk ``2*cp-1-position``); contiguous (``cp``
    slices): slice ``position``. Sequences one after another.
    """

    padded: tuple[int, ...]
    real: tuple[int, ...]
    cp: int
    position: int
    mode: str = DEFAULT_CP_PARTITION_MODE
    device: str = "cpu"
    grouped: bool = False

    def __post_init__(self) -> None:
        check_partition_mode(self.mode)

    @property
    def groupable(self) -> bool:
        """Whether grouping the halves makes them slices (packed zigzag chunks at CP > 1)."""
        return not self.grouped and not self.contiguous and not self.is_dense and self.cp > 1

    @property
    def grouping_moves_tokens(self) -> bool:
        """Whether :func:`half_grouping` is other than the identity: at least two sequences
        hold tokens (one sequence is already its first half, then its second)."""
        return sum(1 for n in self.padded if n) > 1

    def with_grouped_halves(self) -> SeqLayout:
        """This layout with its tokens in :func:`half_grouping` order (only where
        :attr:`groupable`)."""
        if not self.groupable:
            raise ValueError(
                f"with_grouped_halves: this layout (mode={self.mode!r}, cp={self.cp}, "
                f"{len(self.padded)} sequence(s), grouped={self.grouped}) is not groupable; "
                "grouping applies once, to packed zigzag sequences at CP > 1")
        return replace(self, grouped=True)

    @classmethod
    def dense(cls, seq_len_local: int, cp: int, position: int,
              mode: str = DEFAULT_CP_PARTITION_MODE, device: str = "cpu") -> SeqLayout:
        full = seq_len_local * cp
        return cls((full,), (full,), cp, position, mode, device)

    @property
    def local_tokens(self) -> int:
        return sum(self.padded) // self.cp

    @property
    def has_padding(self) -> bool:
        return self.padded != self.real

    @property
    def is_dense(self) -> bool:
        """One unpadded sequence: halves are slices and no mask is needed."""
        return len(self.padded) == 1 and not self.has_padding

    @property
    def contiguous(self) -> bool:
        return self.mode == "contiguous"

    def at(self, cp: int, position: int) -> SeqLayout:
        return replace(self, cp=cp, position=position)

    def on_host(self) -> SeqLayout:
        """This layout with its metadata on the CPU (planning that reads values)."""
        return replace(self, device="cpu")

    @property
    def _meta(self) -> tuple[torch.Tensor, ...]:
        # every ring step asks for another position's layout: compute each one once
        return _layout_meta_on(self.padded, self.real, self.cp, self.position, self.mode,
                               self.device, self.grouped)

    @property
    def seq_id(self) -> torch.Tensor:
        return self._meta[0]

    @property
    def pos(self) -> torch.Tensor:
        return self._meta[1]

    @property
    def valid(self) -> torch.Tensor:
        return self._meta[2]

    def half(self, which: str) -> slice | torch.Tensor:
        """Local token selector of the ``"first"``/``"second"`` half (zigzag), or ``"all"``."""
        n = self.local_tokens
        if which == "all":
            return slice(0, n)
        if self.contiguous:
            raise ValueError("the contiguous layout has no halves")
        if self.is_dense or self.grouped:
            return slice(0, n // 2) if which == "first" else slice(n // 2, n)
        return self._meta[3] if which == "first" else self._meta[4]


def a2a_gather_permutation(layout: SeqLayout, a2a_size: int) -> torch.Tensor:
    """Index that turns the a2a-gathered sequence into the same layout one level up.

    After the a2a, the shards of the a2a group (flat CP positions ``P*a + i``, i = 0..a-1) are
    concatenated in a2a order; the result must be the layout of CP size ``cp/a`` at position
    ``P``. Zigzag: per sequence, the first halves of i = 0..a-1, then the second halves of
    i = a-1..0 (chunks ``P*a .. P*a+a-1`` and their mirror images, in increasing order).
    Contiguous: per sequence, the slices of i = 0..a-1 (slice ``P`` of ``cp/a``).
    """
    if layout.grouped:
        raise ValueError("a2a_gather_permutation takes the layout as the ranks hold it, not "
                         "one with grouped halves")
    local = layout.local_tokens
    out = []
    offset = 0
    if layout.contiguous:
        for p in layout.padded:
            c = p // layout.cp
            out += [torch.arange(i * local + offset, i * local + offset + c)
                    for i in range(a2a_size)]
            offset += c
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
    for p in layout.padded:
        c = p // (2 * layout.cp)
        for i in range(a2a_size):
            base = i * local + offset
            out.append(torch.arange(base, base + c))
        for i in reversed(range(a2a_size)):
            base = i * local + offset + c
            out.append(torch.arange(base, base + c))
        offset += 2 * c
    return torch.cat(out)
