"""The LSE merge of one block's partial attention into a rank's running output: eager or fused.

Every block of CP attention gives its query rows an output and an LSE. A later block's share of
a row is ``w = exp(lse_blk - logaddexp(lse, lse_blk)) = sigmoid(lse_blk - lse)``; the row
becomes ``lerp(out, out_blk, w)`` and its LSE ``logaddexp(lse, lse_blk)``. The first block of
a row is copied in (what the merge gives on an output of 0 and an LSE of ``-inf``).

* **eager** - four kernels a merge (sub, sigmoid, lerp, logaddexp), one more where a block may
  have rows that see no key (their ``w`` is NaN: set to 0), one more where the block output is
  in half precision (its conversion to the fp32 accumulator), and a gather and two scatters
  where the block's rows are an index (a window's trimmed rows).
* **fused** - the same merge as one compiled function (:mod:`.gpu.fused`:
  ``MEGATRON_HCP_FUSED_OPS``), the gather and scatters included, in the forms that compile to
  the fewest Triton kernels (:func:`_fused_rows`, :func:`_fused_index`): :data:`FUSED_KERNELS`
  on a GPU.
"""

from __future__ import annotations

import torch

from .block_counter import record_merge
from .gpu import fuses, run_fused
from .launches import fused_region

__all__ = ["merge_into"]


def _share(lse: torch.Tensor, lse_b: torch.Tensor, empty_rows: bool) -> torch.Tensor:
    """The block's share ``w`` of each row (0 where no key reached the row yet)."""
    w = torch.sigmoid(lse_b - lse)
    return w.nan_to_num_(nan=0.0) if empty_rows else w


def _merge_rows(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor,
                lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """Merge a block into the rows ``out`` [B,H,R,Dv], ``lse`` [B,H,R] (views of the
    accumulators, written in place)."""
    lse_b = lse_blk.to(lse.dtype)
    w = _share(lse, lse_b, empty_rows)  # rows no key reached yet (-inf - -inf): out 0
    out.lerp_(out_blk.to(out.dtype), w.unsqueeze(-1))
    if torch.compiler.is_dynamo_compiling():  # dynamo (a user's compile) takes no out=
        lse.copy_(torch.logaddexp(lse, lse_b))
    else:
        torch.logaddexp(lse, lse_b, out=lse)


def _merge_index(out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: torch.Tensor,
                 out_blk: torch.Tensor, lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """Merge a block into the accumulator rows ``rows`` (an index): gather, merge, scatter."""
    out, lse = out_acc.index_select(2, rows), lse_acc.index_select(2, rows)
    _merge_rows(out, lse, out_blk, lse_blk, empty_rows)
    out_acc.index_copy_(2, rows, out)
    lse_acc.index_copy_(2, rows, lse)


def _fused_rows(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor,
                lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """:func:`_merge_rows` as compiled: ``out + w * (out_blk - out)`` in place of ``lerp_``,
    whose result inductor writes back in a kernel of its own where the accumulator is
    [B,S,H,D] in memory (the backend's layout: 3 Triton kernels instead of 2, measured on an
    H200 with torch 2.11)."""
    lse_b = lse_blk.to(lse.dtype)
    w = _share(lse, lse_b, empty_rows)
    out.add_(w.unsqueeze(-1) * (out_blk.to(out.dtype) - out))
    lse.copy_(torch.logaddexp(lse, lse_b))


def _fused_index(out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: torch.Tensor,
                 out_blk: torch.Tensor, lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """:func:`_merge_index` as compiled: the merged rows written with an index assignment
    (``index_put_``; ``index_copy_`` of rows merged in place takes one Triton kernel more)."""
    out, lse = out_acc[:, :, rows], lse_acc[:, :, rows]
    lse_b = lse_blk.to(lse.dtype)
    w = _share(lse, lse_b, empty_rows)
    out_acc[:, :, rows] = torch.lerp(out, out_blk.to(out.dtype), w.unsqueeze(-1))
    lse_acc[:, :, rows] = torch.logaddexp(lse, lse_b)


# What torch.compile compiles: one function (one code object, so one cache of compiled
# variants, each dtype pair one of them) per kind of rows and per empty_rows
def _fused_rows_dense(*args) -> None:
    _fused_rows(*args, False)


def _fused_rows_masked(*args) -> None:
    _fused_rows(*args, True)


def _fused_index_dense(*args) -> None:
    _fused_index(*args, False)


def _fused_index_masked(*args) -> None:
    _fused_index(*args, True)


# the Triton kernels of a fused merge (the LSE over [rows] and the output over [rows, head
# dim] cannot share one; gathered rows add a scatter each): what the launch proxy counts, and
# at most what tests/gpu accepts - measured on an H200 (torch 2.11, fp32 accumulators in the
# backend's layout, a bf16 block, rows a slice and an index)
FUSED_KERNELS = {"rows": 2, "index": 4}

FUSED = {("rows", False): _fused_rows_dense, ("rows", True): _fused_rows_masked,
          ("index", False): _fused_index_dense, ("index", True): _fused_index_masked}


def merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    rows: slice | torch.Tensor,
    out_blk: torch.Tensor,
    lse_blk: torch.Tensor,
    *,
    first: bool = False,
    empty_rows: bool = True,
) -> None:
    """Merge a block result into the running (out, lse) at query ``rows`` (in place).

    ``out_acc`` [B,H,S,Dv] and ``lse_acc`` [B,H,S] are in the accumulation dtype. ``first``: no
    block was merged into ``out_acc`` yet (out 0, LSE ``-inf`` everywhere), so the block is
    copied in - exactly what the merge gives. Otherwise the module docstring's merge, eager or
    fused (:func:`~.gpu.fused.fuses`; counted in every active
    :class:`~.block_counter.BlockCounter`).
    ``empty_rows``: the block may have rows that see no key (LSE ``-inf``: a mask, or a bias
    with ``-inf``); without it every row of the block saw a key (dense blocks), and no row can
    turn to NaN.
    """
    if first:  # a copy converts the dtype on the way
        if isinstance(rows, slice):
            out_acc[:, :, rows].copy_(out_blk)
            lse_acc[:, :, rows].copy_(lse_blk)
        else:
            out_acc.index_copy_(2, rows, out_blk.to(out_acc.dtype))
            lse_acc.index_copy_(2, rows, lse_blk.to(lse_acc.dtype))
        return
    if isinstance(rows, slice):
        name, args = "rows", (out_acc[:, :, rows], lse_acc[:, :, rows], out_blk, lse_blk)
    else:
        name, args = "index", (out_acc, lse_acc, rows, out_blk, lse_blk)
    if fuses(out_acc.device, out_blk.numel()) and run_fused(FUSED[name, empty_rows], *args)[0]:
        record_merge("fused")
        return
    with fused_region("megatron_hcp::fused_merge", FUSED_KERNELS[name]):  # the fused path's
        (_merge_rows if name == "rows" else _merge_index)(*args, empty_rows)
    record_merge("eager")
