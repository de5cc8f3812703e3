"""Load-balanced CP sharding of sequences, as megatron's ``get_batch_on_this_cp_rank`` does it.

Every sequence is cut into ``2*cp`` equal chunks; CP position ``r`` holds chunks ``r`` and
``2*cp-1-r`` (its *first* and *second half*), so causal attention work is the same on every rank.
For packed ``thd`` data each sequence is cut that way separately, so every padded sequence length
must be a multiple of ``2*cp`` (:func:`pad_thd` pads). ``cu_seqlens`` always describe the full
(unsharded) packed batch, as in Transformer Engine and megatron's ``PackedSeqParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

__all__ = [
    "CPAttentionError",
    "SeqLayout",
    "assemble_from_chunks",
    "gather_from_cp",
    "get_local_chunk",
    "pad_thd",
    "seq_dim",
    "seq_lengths",
    "thd_partition_indices",
    "a2a_gather_permutation",
]


class CPAttentionError(ValueError):
    """Bad input to CP attention, raised before any collective starts."""


def seq_dim(qkv_format: str) -> int:
    """The sequence dimension of a ``bshd``, ``sbhd`` or ``thd`` tensor."""
    try:
        return {"bshd": 1, "sbhd": 0, "thd": 0}[qkv_format]
    except KeyError:
        raise CPAttentionError(
            f"qkv_format={qkv_format!r}: use one of bshd, sbhd, thd"
        ) from None


def seq_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


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
                "truncated silently). Pad with megatron_hcp.attention.reference.pad_thd and "
                f"pass its cu_seqlens as cu_seqlens_{name}_padded"
            )


def _check_cp_position(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise CPAttentionError(
            f"cp_size={cp_size}, cp_rank={cp_rank}: need cp_size >= 1 and 0 <= cp_rank < cp_size")


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


def thd_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
                          ) -> torch.Tensor:
    """Global token indices held by ``cp_rank`` (TE's ``thd_get_partitioned_indices``).

    Every sequence length in ``cu_seqlens_padded`` must be a multiple of ``2*cp_size``
    (:func:`pad_thd`); anything else would drop tokens, so it is refused."""
    _check_cp_position(cp_size, cp_rank)
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise CPAttentionError(f"cu_seqlens_padded={cu} must start at 0 and be non-decreasing")
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if (end - start) % (2 * cp_size):
            raise CPAttentionError(
                f"sequence {i} has length {end - start}, not a multiple of 2*cp_size="
                f"{2 * cp_size}: sharding it would silently drop tokens. Pad every sequence "
                "with megatron_hcp.attention.reference.pad_thd and pass its cu_seqlens_padded")
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def get_local_chunk(
    x: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """This CP rank's shard of a global tensor (chunks ``r`` and ``2*cp-1-r``)."""
    dim = seq_dim(qkv_format)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise CPAttentionError("thd needs cu_seqlens_padded to cut sequences")
        idx = thd_partition_indices(cu_seqlens_padded, cp_size, cp_rank).to(x.device)
        return x.index_select(dim, idx)
    _check_cp_position(cp_size, cp_rank)
    if x.shape[dim] % (2 * cp_size):
        raise CPAttentionError(
            f"sequence length {x.shape[dim]} is not divisible by 2*cp_size={2 * cp_size}: "
            "pad the sequence to a multiple of 2*cp_size (thd: pad_thd)"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def assemble_from_chunks(
    chunks: list[torch.Tensor],
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`get_local_chunk`: the global tensor from every rank's shard."""
    cp = len(chunks)
    dim = seq_dim(qkv_format)
    if qkv_format == "thd":
        if cu_seqlens_padded is None:
            raise CPAttentionError("thd needs cu_seqlens_padded to reassemble sequences")
        total = int(cu_seqlens_padded[-1])
        shape = list(chunks[0].shape)
        shape[dim] = total
        out = chunks[0].new_zeros(shape)
        for r, chunk in enumerate(chunks):
            idx = thd_partition_indices(cu_seqlens_padded, cp, r).to(chunk.device)
            out.index_copy_(dim, idx, chunk)
        return out
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, chunk in enumerate(chunks):
        a, b = chunk.chunk(2, dim=dim)
        pieces[r], pieces[2 * cp - 1 - r] = a, b
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def gather_from_cp(
    local: torch.Tensor,
    cp_group: dist.ProcessGroup,
    qkv_format: str = "bshd",
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather every rank's shard over ``cp_group`` and reassemble the global tensor."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    return assemble_from_chunks(parts, qkv_format, cu_seqlens_padded)


def pad_thd(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every packed sequence of ``x`` (``[t, ...]``) to a multiple of ``2*cp_size``.

    Returns the padded tensor (zeros after each sequence) and its ``cu_seqlens_padded``.
    """
    lengths = seq_lengths(cu_seqlens)
    unit = 2 * cp_size
    padded = [-(-n // unit) * unit for n in lengths]
    cu_pad = torch.zeros(len(padded) + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    cu_pad[1:] = torch.tensor(padded, dtype=cu_seqlens.dtype).cumsum(0)
    out = x.new_zeros((int(cu_pad[-1]), *x.shape[1:]))
    src = [int(v) for v in cu_seqlens.tolist()]
    for i, n in enumerate(lengths):
        out[int(cu_pad[i]) : int(cu_pad[i]) + n] = x[src[i] : src[i] + n]
    return out, cu_pad


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
