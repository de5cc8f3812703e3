"""The gradient accumulators of CP attention's backward: each block's gradient rows added in.

A block kernel returns dq for its rows and dK/dV for its columns; the backward adds them into
accumulators of every row. A zeroed accumulator beside the first block's own gradient is two
tensors of q's size where a single attention call has one: :class:`LazyRows` is allocated by its
first gradient instead, and where that gradient covers every row it *is* the accumulator.
"""

from __future__ import annotations

import torch

__all__ = ["LazyRows", "add_rows"]

Selector = slice | torch.Tensor


class LazyRows:
    """An accumulator of ``shape`` [B, H, S, D] in ``dtype``, made by its first :meth:`add`:
    the gradient itself (in ``dtype``) where it covers every row and owns its whole storage
    (a kernel's output, in whatever dimension order: CUDA's flash backward returns dq as a
    transposed view), else zeros with it added."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device
        self._acc: torch.Tensor | None = None

    def add(self, sel: Selector, grad: torch.Tensor) -> None:
        """Add ``grad`` into the rows ``sel`` (a slice of them, or their index)."""
        if self._acc is None:
            rows = self.shape[2]
            whole = isinstance(sel, slice) and range(rows)[sel] == range(rows)
            if whole and grad.shape == self.shape and _owns_storage(grad):
                self._acc = grad.to(self.dtype)  # the kernel's own tensor (or its copy)
                return
            self._acc = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        add_rows(self._acc, sel, grad)

    def value(self) -> torch.Tensor:
        """The sum of what was added (zeros where nothing was)."""
        if self._acc is None:
            self._acc = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._acc


def _owns_storage(t: torch.Tensor) -> bool:
    """``t`` is all of its storage, each element once (no slice or broadcast of another)."""
    return (t.storage_offset() == 0 and all(st > 0 for st, n in zip(t.stride(), t.shape) if n > 1)
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def add_rows(acc: torch.Tensor | LazyRows, sel: Selector, grad: torch.Tensor) -> None:
    """``acc[:, :, sel] += grad`` in place (``sel`` a slice or an index of dim 2)."""
    if isinstance(acc, LazyRows):
        acc.add(sel, grad)
    elif isinstance(sel, slice):
        acc[:, :, sel].add_(grad)  # not `+=`: its copy back is one more op
    else:
        acc.index_add_(2, sel, grad.to(acc.dtype))
