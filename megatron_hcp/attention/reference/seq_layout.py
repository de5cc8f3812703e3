"""Where the tokens of a CP position sit inside the attention kernels (:class:`SeqLayout`), the
validation of packed-sequence metadata, and the a2a re-ordering; which tokens a rank holds is
:mod:`megatron_hcp.sharding`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...sharding import ShardingError, seq_lengths

__all__ = ["CPAttentionError", "SeqLayout", "a2a_gather_permutation", "check_cu_seqlens"]

# bad input to CP attention, raised before any collective starts: the sharding error (one class,
# so callers catch attention and sharding input errors alike)
CPAttentionError = ShardingError


def check_cu_seqlens(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, name: str = "q"
) -> None:
    """Validate packed-sequence metadata; raise :class:`CPAttentionError` naming the problem."""
    for label, cu in ((f"cu_seqlens_{name}", cu_seqlens),
                      (f"cu_seqlens_{name}_padded", cu_seqlens_padded)):
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
            raise CPAttentionError(f"{label} must be 1-D, start at 0 and hold >= 2 entries")
        if bool((cu[1:] < cu[:-1]).any()):
            raise CPAttentionError(f"{label}={cu.tolist()} must be non-decreasing")
    if cu_seqlens.numel() != cu_seqlens_padded.numel():
        raise CPAttentionError(
            f"cu_seqlens_{name} and cu_seqlens_{name}_padded describe a different number of "
            "sequences"
        )
    real, padded = seq_lengths(cu_seqlens), seq_lengths(cu_seqlens_padded)
    for i, (n, p) in enumerate(zip(real, padded)):
        if p < n:
            raise CPAttentionError(
                f"sequence {i}: padded length {p} < real length {n} in cu_seqlens_{name}_padded"
            )
        if p % (2 * cp_size):
            raise CPAttentionError(
                f"sequence {i}: padded length {p} is not a multiple of 2*cp_size={2 * cp_size}; "
                "every packed sequence must be padded to a multiple of 2*CP (nothing is "
                "truncated silently). Pad with megatron_hcp.sharding.pad_thd and "
                f"pass its cu_seqlens as cu_seqlens_{name}_padded"
            )


@lru_cache(maxsize=256)
def _layout_meta(padded: tuple[int, ...], real: tuple[int, ...], cp: int, position: int
                 ) -> tuple[torch.Tensor, ...]:
    """Per-token sequence id, position, validity and the two halves' token indices."""
    seq_ids, positions, first, second = [], [], [], []
    offset = 0
    mirror = 2 * cp - 1 - position
    for i, p in enumerate(padded):
        c = p // (2 * cp)
        for chunk, bucket in ((position, first), (mirror, second)):
            pos = torch.arange(chunk * c, (chunk + 1) * c)
            positions.append(pos)
            seq_ids.append(torch.full((c,), i))
            bucket.append(torch.arange(offset, offset + c))
            offset += c

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)

    seq_id, pos = cat(seq_ids), cat(positions)
    length = torch.tensor(real)[seq_id] if len(seq_id) else seq_id
    return seq_id, pos, pos < length, cat(first), cat(second)


@dataclass(frozen=True)
class SeqLayout:
    """Where the tokens of one CP position sit (``thd``: per sequence; else one sequence).

    ``padded[i]`` / ``real[i]``: padded and real length of sequence i; ``cp``/``position``:
    the chunking (``2*cp`` chunks) and which CP position this layout describes. Local tokens of
    sequence i are its first half (chunk ``position``) then its second half (chunk
    ``2*cp-1-position``), sequences one after another.
    """

    padded: tuple[int, ...]
    real: tuple[int, ...]
    cp: int
    position: int

    @classmethod
    def dense(cls, seq_len_local: int, cp: int, position: int) -> SeqLayout:
        full = seq_len_local * cp
        return cls((full,), (full,), cp, position)

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

    def at(self, cp: int, position: int) -> SeqLayout:
        return SeqLayout(self.padded, self.real, cp, position)

    @property
    def _meta(self) -> tuple[torch.Tensor, ...]:
        # every ring step asks for another position's layout: compute each one once
        return _layout_meta(self.padded, self.real, self.cp, self.position)
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
        """Local token selector of the ``"first"``/``"second"`` half, or ``"all"``."""
        n = self.local_tokens
        if which == "all":
            return slice(0, n)
        if self.is_dense:
            return slice(0, n // 2) if which == "first" else slice(n // 2, n)
        return self._meta[3] if which == "first" else self._meta[4]


def a2a_gather_permutation(layout: SeqLayout, a2a_size: int) -> torch.Tensor:
    """Index that turns the a2a-gathered sequence into the two-halves layout one level up.

    After the a2a, the shards of the a2a group (flat CP positions ``P*a + i``, i = 0..a-1) are
    concatenated in a2a order; the result must be the layout of CP size ``cp/a`` at position
    ``P``: per sequence, the first halves of i = 0..a-1, then the second halves of i = a-1..0
    (chunks ``P*a .. P*a+a-1`` and their mirror images, in increasing order).
    """
    local = layout.local_tokens
    out = []
    offset = 0
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
