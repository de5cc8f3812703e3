"""Counting what the attention ran: :class:`BlockCounter` (a context manager) and the
``record_*`` calls the blocks, kernels, merges and masks make into every active counter."""

from __future__ import annotations

import contextvars
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["COUNTERS", "BlockCounter", "record_kernel", "record_mask", "record_merge"]

#: the counters active in this context, innermost last
COUNTERS: contextvars.ContextVar[tuple[BlockCounter, ...]] = contextvars.ContextVar(
    "megatron_hcp_block_counters", default=()
)


@dataclass
class BlockCounter:
    """Context manager counting this rank's forward attention blocks: ``computed`` holds the
    (query rows, key columns) of each block run, ``skipped`` the number of blocks a sliding
    window saw nothing of (their K/V still travel: other ranks need them), ``kernels`` the
    kernel calls per (kernel, reason it is not a fused one) - see :mod:`.kernels` - and, per
    path (``"fused"``, ``"eager"``: :mod:`.gpu.fused`), ``merges`` the LSE merges
    (:mod:`.merge`) and ``masks`` the additive masks built (:meth:`~.masks.BlockMask.additive`)."""

    computed: list[tuple[int, int]] = field(default_factory=list)
    skipped: int = 0
    kernels: Counter = field(default_factory=Counter)
    merges: Counter = field(default_factory=Counter)
    masks: Counter = field(default_factory=Counter)
    _token: contextvars.Token | None = field(default=None, repr=False)

    def __enter__(self) -> BlockCounter:
        self._token = COUNTERS.set(COUNTERS.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        COUNTERS.reset(self._token)
        self._token = None

    @property
    def pairs(self) -> int:
        """Query-key pairs computed (rows x columns, per batch and head)."""
        return sum(r * c for r, c in self.computed)


def _record(tally: str, key: object) -> None:
    """Count ``key`` once in the ``tally`` (a Counter field) of every active
    :class:`BlockCounter`."""
    for counter in COUNTERS.get():
        getattr(counter, tally)[key] += 1


def record_kernel(kernel: str, reason: str = "") -> None:
    """Count one forward kernel call in every active :class:`BlockCounter`."""
    _record("kernels", (kernel, reason))


def record_merge(path: str) -> None:
    """Count one LSE merge (``"fused"`` or ``"eager"``) in every active :class:`BlockCounter`."""
    _record("merges", path)


def record_mask(path: str) -> None:
    """Count one additive mask built (``"fused"`` or ``"eager"``) in every active
    :class:`BlockCounter`."""
    _record("masks", path)
