"""A packed block's pieces in a few FlashAttention-2 varlen calls (CUDA) instead of one each.

:mod:`..pieces` cuts a packed (``thd``) block into dense pieces, one per pair of a sequence's
runs; on their own, each piece is a kernel call, a merge and its gradients' adds, so a block of
many short sequences costs many launches. FlashAttention-2's variable-length kernel
(``aten::_flash_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k``, as
torch's own nested-tensor SDPA calls it) computes a batch of segments in one call, segment
``i`` being query rows ``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i+1]`` of one
[total, heads, head dim] tensor each. A *chain* of pieces whose rows and columns both increase
(every sequence's causal square of the block in the grouped zigzag layout; every sequence's
query half against its key half) is such a batch: the runs between two pieces (padding, the
tokens of sequences with nothing in the pair) become segments of rows without keys (FA2
writes output 0 and LSE ``+inf`` for them, read here as ``-inf``) and of keys without rows.
A block takes one call per chain whatever the number of sequences: at most two with a causal
mask (the diagonal squares and the keys before the queries), three without. A windowed block
(dense or packed) becomes bands under FA2's own sliding window (:mod:`..bands`), chained the
same way per window: at most four calls for one sequence; packed sequences of different
lengths give bands of different windows, a chain each, and the block takes its calls only
where they cost less than its mask (:func:`~..pieces.worth_splitting`).

``MEGATRON_HCP_VARLEN`` chooses for blocks computed in pieces: ``auto`` (the default: on CUDA
where FlashAttention-2 takes the block's q/k/v - fp16/bf16, one head dim, a multiple of 8 up
to 256 - and the kernel matched :func:`reference_forward` / :func:`reference_backward` on a
small packing once per process, dtype and GPU; otherwise the pieces one by one, with one
warning where the check failed), ``on`` (wherever FlashAttention-2 takes the block, without
the check), ``off`` (the pieces one by one). No CPU kernel takes segments: on the CPU the
pieces always run one by one. Not while a CUDA graph is captured (the calls' offsets are
built on the device once per packing, from the host). The backward plans as its forward did
(the choice is saved with it), though either way gives the same result: it works from the
merged output and LSE.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from functools import lru_cache
from typing import NamedTuple

import torch

from ..bands import Band
from ..kernel_support import CUDA_FLASH, acc_dtype, torch_accepts
from ..pieces import Piece
from ..switches import Switch
from .fused import _capturing

__all__ = ["VARLEN", "VARLEN_ENV", "VARLEN_KERNEL", "VARLEN_MODES", "VarlenCall", "fa2_checked",
           "fa2_visible", "forget_kernel_checks", "kernel_calls", "kernel_matches_reference",
           "max_seqlens", "reference_backward", "reference_forward", "varlen_backward",
           "varlen_calls", "varlen_forward", "varlen_mode", "varlen_takes", "varlening"]

VARLEN_ENV = "MEGATRON_HCP_VARLEN"
VARLEN_MODES = ("auto", "on", "off")
VARLEN_KERNEL = "cuda_flash_varlen"  # as counted in BlockCounter.kernels

VARLEN = Switch(
    "varlen", VARLEN_ENV, VARLEN_MODES,
    "auto (the default: a packed block's pieces in FlashAttention-2 varlen calls on CUDA once "
    "the kernel matched the reference on this GPU), on (without that check) or off (the "
    "pieces one call each)")


def varlen_mode() -> str:
    """``MEGATRON_HCP_VARLEN`` as :func:`varlening` chose it here, else as set (default
    ``auto``), checked against :data:`VARLEN_MODES`."""
    return VARLEN.mode()


def varlening(mode: str):
    """Blocks in pieces computed as ``mode`` inside the block, in this thread
    (:class:`~..switches.Switch`)."""
    return VARLEN.chosen(mode)


class VarlenCall(NamedTuple):
    """One varlen call: local query rows ``[row, row + rows)`` against key columns
    ``[col, col + cols)``, cut into segments of ``q_lens`` rows against ``k_lens`` columns
    (in order, covering both spans); ``causal``: every segment with both is a causal square;
    ``window``: FA2's sliding window of every segment (bottom-right aligned, ``-1`` unbounded:
    :mod:`..bands`)."""

    row: int
    rows: int
    col: int
    cols: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool
    window: tuple[int, int] = (-1, -1)

    @property
    def row_span(self) -> slice:
        return slice(self.row, self.row + self.rows)

    @property
    def col_span(self) -> slice:
        return slice(self.col, self.col + self.cols)

    @property
    def empty_rows(self) -> bool:
        """Whether some rows of the call see no key (segments of rows without keys)."""
        return any(q and not k for q, k in zip(self.q_lens, self.k_lens))


Kind = bool | tuple[int, int] | None


def _kind(piece: Piece | Band) -> Kind:
    """``True`` for a causal square, ``False`` for a full rectangle, a band's window, or
    ``None`` for one token against one (the same pair every way: it joins a chain of any
    kind)."""
    if piece.rows == piece.cols == 1:
        return None
    return piece.window if isinstance(piece, Band) else piece.causal


def _chains(pieces: tuple[Piece | Band, ...]) -> list[tuple[Kind, list]]:
    """``pieces`` as chains of one kind (causal squares, full rectangles, bands of one
    window) whose rows and columns both increase: in order of row and column, each piece
    joins the first chain of its kind it extends."""
    chains: list[list] = []  # [kind (None while only 1 x 1 pieces), pieces]
    for piece in sorted(pieces, key=lambda p: (p.row, p.col)):
        kind = _kind(piece)
        for chain in chains:
            last = chain[1][-1]
            if (kind is None or chain[0] is None or chain[0] == kind) and (
                    piece.row >= last.row + last.rows and piece.col >= last.col + last.cols):
                chain[0] = kind if chain[0] is None else chain[0]
                chain[1].append(piece)
                break
        else:
            chains.append([kind, [piece]])
    return [(kind, chain) for kind, chain in chains]


def _call(kind: Kind, chain: list) -> VarlenCall:
    """The segments of one chain: each piece, and before it the rows and the columns since the
    previous one as a segment of rows without keys and one of keys without rows."""
    q_lens: list[int] = []
    k_lens: list[int] = []
    row, col = chain[0].row, chain[0].col
    for piece in chain:
        if piece.row > row:
            q_lens.append(piece.row - row)
            k_lens.append(0)
        if piece.col > col:
            q_lens.append(0)
            k_lens.append(piece.col - col)
        q_lens.append(piece.rows)
        k_lens.append(piece.cols)
        row, col = piece.row + piece.rows, piece.col + piece.cols
    first = chain[0]
    window = kind if isinstance(kind, tuple) else (-1, -1)
    return VarlenCall(first.row, row - first.row, first.col, col - first.col, tuple(q_lens),
                      tuple(k_lens), kind is True, window)


@lru_cache(maxsize=256)  # a packing needs a few per position
def varlen_calls(pieces: tuple[Piece | Band, ...]) -> tuple[VarlenCall, ...]:
    """The varlen calls that compute exactly the pairs of ``pieces`` (one per chain)."""
    return tuple(_call(kind, chain) for kind, chain in _chains(pieces))


# FA2's varlen backward accumulates dq in an fp32 buffer of (rows + 128 per segment) x heads x
# head dim (rounded up), whose row offsets it computes in 32 bits (flash_bwd_kernel.h, as
# torch builds it: the offset of a segment's rows, a bound this keeps the whole buffer within,
# which is safe); its grid takes at most 65535 segments (gridDim.y). Calls past either run in
# parts.
_DQ_ACCUM_ELEMENTS = 2**31
_MAX_SEGMENTS = 65535


def _rounded_head_dim(d: int) -> int:
    """FA2's ``head_size_rounded``: a multiple of 8, then of 32 (up to 128) or 64."""
    d = -(-d // 8) * 8
    step = 32 if d <= 128 else 64
    return -(-d // step) * step


@lru_cache(maxsize=256)
def kernel_calls(calls: tuple[VarlenCall, ...], heads: int, head_dim: int
                 ) -> tuple[VarlenCall, ...] | None:
    """``calls`` as FA2 runs them for ``heads`` query heads of ``head_dim``: each cut at
    segment boundaries into parts whose dq buffer stays within 32-bit offsets
    (:data:`_DQ_ACCUM_ELEMENTS`) and whose segments fit its grid; ``None`` where one segment
    alone does not (its pieces then run one call each, on the dense kernels)."""
    per_row = heads * _rounded_head_dim(head_dim)
    parts: list[VarlenCall] = []
    for call in calls:
        row, col, first = call.row, call.col, 0
        rows = count = 0
        for i, q in enumerate(call.q_lens):
            if (q + 128) * per_row >= _DQ_ACCUM_ELEMENTS:
                return None
            if (rows + q + 128 * (count + 1)) * per_row >= _DQ_ACCUM_ELEMENTS or (
                    count == _MAX_SEGMENTS):
                parts.append(_part(call, first, i, row, col))
                row += rows
                col += sum(call.k_lens[first:i])
                first, rows, count = i, 0, 0
            rows += q
            count += 1
        parts.append(_part(call, first, len(call.q_lens), row, col))
    return tuple(part for part in parts if part is not None)


def _part(call: VarlenCall, first: int, stop: int, row: int, col: int) -> VarlenCall | None:
    """Segments ``first:stop`` of ``call``, starting at local row ``row`` and column ``col``,
    without the segments of rows without keys or keys without rows it starts or ends with
    (they compute nothing, and give nothing to merge); ``None`` where nothing is left."""
    q_lens, k_lens = list(call.q_lens[first:stop]), list(call.k_lens[first:stop])
    while q_lens and not (q_lens[0] and k_lens[0]):
        row, col = row + q_lens.pop(0), col + k_lens.pop(0)
    while q_lens and not (q_lens[-1] and k_lens[-1]):
        q_lens.pop()
        k_lens.pop()
    if not q_lens:
        return None
    return VarlenCall(row, sum(q_lens), col, sum(k_lens), tuple(q_lens), tuple(k_lens),
                      call.causal, call.window)


@lru_cache(maxsize=256)
def _cumulative(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Segment offsets ``[0, l0, l0 + l1, ...]`` as int32 on ``device``: once per packing."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def max_seqlens(call: VarlenCall) -> tuple[int, int]:
    """The ``max_seqlen_q`` / ``max_seqlen_k`` a call gets: at least 2 (FA2 treats a batch
    whose queries all have one row as one query per segment - GQA's swapped layout - which
    gaps would break), and ``max_seqlen_k`` at least every segment's rows too: FA2 takes a
    window side of ``max_seqlen_k`` or more as unbounded and then bounds it at
    ``max_seqlen_k`` again (:func:`fa2_visible`), which leaves a segment of more rows than
    that without keys it should see. Both are bounds only (extra thread blocks exit)."""
    max_q = max(2, *call.q_lens)
    return max_q, max(max_q, *call.k_lens)


def fa2_visible(rows: int, cols: int, causal: bool, window: tuple[int, int], max_k: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The [rows, cols] pairs FlashAttention-2 computes for one segment of a varlen call
    whose ``max_seqlen_k`` is ``max_k``, as its sources do: ``is_causal`` makes the right side
    0; a side of ``max_k`` or more becomes ``-1`` (mha_varlen_fwd / _bwd); a ``-1`` side
    becomes ``max_k`` where the other is not ``-1`` (set_params_fprop / _dgrad); row ``i``
    then sees key ``j`` where ``i + cols - rows - left <= j <= i + cols - rows + right``
    (mask.h: bottom-right aligned, a ``-1`` side unbounded)."""
    left, right = window
    right = 0 if causal else right
    left, right = (-1 if side >= max_k else side for side in (left, right))
    if (left < 0) != (right < 0):
        left, right = (max_k if side < 0 else side for side in (left, right))
    gap = (torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
           - (cols - rows))
    keep = torch.ones(rows, cols, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= gap >= -left
    if right >= 0:
        keep &= gap <= right
    return keep


def _segments(x: torch.Tensor, span: slice, b: int = 0) -> torch.Tensor:
    """Rows ``span`` of batch element ``b`` of ``x`` [B, H, S, D] as FA2 takes them:
    [rows, H, D], head dim contiguous (a view where it already is)."""
    seg = x[b, :, span].transpose(0, 1)
    return seg if seg.stride(-1) == 1 else seg.contiguous()


def _batch(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-batch-element results as one [B, ...] tensor: a view for one (packed data), no
    copy on that path."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=window[0], window_size_right=window[1])
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window):
    none = torch.empty((), dtype=torch.int64)  # philox seed / offset: unused without dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, none, none,
        scale=scale, window_size_left=window[0], window_size_right=window[1])
    return dq, dk, dv


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: VarlenCall,
                   scale: float, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's output [B, H, rows, Dv] (q's dtype) and LSE [B, H, rows] (fp32; ``-inf``
    for rows without keys) from ``q`` [B, H, Sq, D], ``k``/``v`` [B, Hkv, Sk, D] (one call
    per batch element: a segment is rows of one sequence); ``kernel``: FA2's varlen forward
    (default) or one with its arguments and results (:func:`reference_forward`)."""
    device = q.device
    cu_q, cu_k = _cumulative(call.q_lens, device), _cumulative(call.k_lens, device)
    rows, cols = call.row_span, call.col_span
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = (kernel or _flash_forward)(
            _segments(q, rows, b), _segments(k, cols, b), _segments(v, cols, b), cu_q, cu_k,
            *max_seqlens(call), call.causal, scale, call.window)
        if call.empty_rows:  # FA2 writes +inf for a row without keys; a merge reads -inf
            lse.nan_to_num_(nan=float("nan"), posinf=float("-inf"), neginf=float("-inf"))
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    return _batch(outs), _batch(lses)


def varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, call: VarlenCall, scale: float,
                    kernel=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's (dq [B, H, rows, D], dk / dv [B, Hkv, cols, D]) in q's dtype from the final
    output and LSE of its rows (dq 0 on rows without keys, dk / dv 0 on keys without rows);
    ``kernel``: FA2's varlen backward (default) or :func:`reference_backward`."""
    device = q.device
    cu_q, cu_k = _cumulative(call.q_lens, device), _cumulative(call.k_lens, device)
    rows, cols = call.row_span, call.col_span
    grads = []
    for b in range(q.shape[0]):
        grads.append((kernel or _flash_backward)(
            _segments(dout, rows, b).to(q.dtype), _segments(q, rows, b),
            _segments(k, cols, b), _segments(v, cols, b), _segments(out, rows, b).to(q.dtype),
            lse[b, :, rows].to(acc_dtype(q.dtype)).contiguous(), cu_q, cu_k,
            *max_seqlens(call), call.causal, scale, call.window))
    return tuple(_batch([g.transpose(0, 1) for g in per_batch]) for per_batch in zip(*grads))


def _segment_scores(q, k, scale, causal, window, max_k):
    """fp32 scores [H, rows, cols] of one segment (K expanded to q's heads), ``-inf`` where
    FA2 computes no pair (:func:`fa2_visible`)."""
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    keep = fa2_visible(q.shape[0], k.shape[0], causal, window, max_k, s.device)
    return s.masked_fill(~keep, float("-inf"))


def _on_one_device(*tensors: torch.Tensor) -> None:
    """FA2's ``CHECK_DEVICE``: every input on the device of the first."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError("varlen attention inputs on several devices: "
                           f"{sorted(map(str, devices))}")


def _bounds(lens: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each segment's ``(start, stop)``."""
    ends = list(itertools.accumulate(lens))
    return [(end - n, end) for n, end in zip(lens, ends)]


def reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(-1, -1)):
    """FlashAttention-2's varlen forward in fp32 math, per segment (what its kernel is checked
    against): q [Tq, H, D], k/v [Tk, Hkv, D(v)]; output [Tq, H, Dv] in q's dtype, LSE [H, Tq]
    fp32; a segment of rows without keys gets output 0 and LSE ``+inf``, as FA2 writes; the
    pairs of a segment as FA2 computes them (:func:`fa2_visible`); inputs on one device, as
    FA2 checks."""
    _on_one_device(q, k, v, cu_q, cu_k)
    heads, acc = q.shape[1], acc_dtype(q.dtype)
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("inf"), dtype=acc, device=q.device)
    for (q0, q1), (k0, k1) in zip(_bounds(_lens(cu_q)), _bounds(_lens(cu_k))):
        if q1 == q0 or k1 == k0:
            continue
        s = _segment_scores(q[q0:q1].to(acc), k[k0:k1].to(acc), scale, causal, window, max_k)
        seg_lse = torch.logsumexp(s, dim=-1)
        vs = v[k0:k1].to(acc).repeat_interleave(heads // v.shape[1], dim=1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.exp(s - seg_lse.unsqueeze(-1)), vs)
        lse[:, q0:q1] = seg_lse
    return out.to(q.dtype), lse


def reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                       window=(-1, -1)):
    """FlashAttention-2's varlen backward in fp32 math, per segment, given the final output and
    LSE [H, Tq] of the rows (the probabilities are ``exp(score - lse)``); gradients in q's
    dtype, dK / dV summed over each group of query heads."""
    _on_one_device(q, k, v, out, dout, lse, cu_q, cu_k)
    heads, kv_heads = q.shape[1], k.shape[1]
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape[0], heads, k.shape[-1], dtype=acc, device=q.device)
    dv = torch.zeros(v.shape[0], heads, v.shape[-1], dtype=acc, device=q.device)
    for (q0, q1), (k0, k1) in zip(_bounds(_lens(cu_q)), _bounds(_lens(cu_k))):
        if q1 == q0 or k1 == k0:
            continue
        qs, ks = q[q0:q1].to(acc), k[k0:k1].to(acc)
        vs = v[k0:k1].to(acc).repeat_interleave(heads // kv_heads, dim=1)
        ke = ks.repeat_interleave(heads // kv_heads, dim=1)
        do, o = dout[q0:q1].to(acc), out[q0:q1].to(acc)
        p = torch.exp(_segment_scores(qs, ks, scale, causal, window, max_k)
                      - lse[:, q0:q1].to(acc)[..., None])
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = p * (dp - (do * o).sum(-1).transpose(0, 1)[..., None]) * scale
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, ke)
        dk[k0:k1] = torch.einsum("hqk,qhd->khd", ds, qs)
    group = heads // kv_heads
    dk = dk.view(k.shape[0], kv_heads, group, k.shape[-1]).sum(2)
    dv = dv.view(v.shape[0], kv_heads, group, v.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _lens(cu: torch.Tensor) -> tuple[int, ...]:
    offsets = cu.tolist()
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def _fa2_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention-2 takes this block's q [B,H,S,D] / k, v [B,Hkv,S,D]: CUDA,
    fp16/bf16, one head dim (a multiple of 8, at most 256), and torch's own check says so
    here (GPU arch, build, ``torch.backends.cuda.enable_flash_sdp``)."""
    d = q.shape[-1]
    if (q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)
            or v.shape[-1] != d or k.shape[-1] != d or d % 8 or d > 256):
        return False
    return torch_accepts(CUDA_FLASH, q, k, v, False)


def varlen_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a block in pieces of these tensors runs as varlen calls (module docstring)."""
    mode = varlen_mode()
    if mode == "on":
        return _fa2_takes(q, k, v) and not _capturing()
    return mode == "auto" and fa2_checked(q, k, v)


def fa2_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention-2 takes these tensors here and its varlen kernel matched the
    reference on their GPU and dtype (``auto``'s condition, whatever ``MEGATRON_HCP_VARLEN``
    says: the benchmark's one-call baseline asks it)."""
    return (_fa2_takes(q, k, v) and not _capturing()
            and kernel_matches_reference(q.device, q.dtype))


def _probe_calls() -> tuple[VarlenCall, ...]:
    """A small packing's calls with every kind of segment: causal squares, full rectangles,
    rows without keys and keys without rows, and bands of three windows (one causal, on
    squares; one on both sides, on a piece with more keys than rows; one bounded on the left
    only, on a piece with more rows than keys: FA2's rules for an unbounded side)."""
    pieces = (Piece(0, 9, 0, 9, True), Piece(12, 5, 12, 5, True), Piece(20, 70, 20, 70, True),
              Piece(12, 5, 0, 9, False), Piece(20, 70, 3, 6, False), Piece(93, 3, 40, 7, False))
    bands = (Band(0, 9, 0, 9, (3, 0)), Band(12, 5, 12, 5, (3, 0)),
             Band(20, 40, 10, 50, (4, 2)), Band(70, 16, 70, 8, (0, -1)))
    return varlen_calls(pieces) + varlen_calls(bands)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal infinities and finite values within 1% of the reference's norm (half precision
    rounds; a wrong layout or mask is off by the whole)."""
    got, want = got.float(), want.float()
    if got.shape != want.shape or not torch.equal(torch.isinf(got), torch.isinf(want)):
        return False
    finite = torch.isfinite(want)
    diff = (got[finite] - want[finite]).norm()
    return bool(diff <= 1e-2 * want[finite].norm() + 1e-3)


# kernel_matches_reference's answers, per (device, dtype): a cache, as lru_cache's would be,
# which a CUDA graph capture can leave unasked
_MATCHED: dict[tuple[torch.device, torch.dtype], bool] = {}
_CHECKING = threading.Lock()


def kernel_matches_reference(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FA2's varlen kernel gives :func:`reference_forward` / :func:`reference_backward`
    on a small GQA packing (:func:`_probe_calls`) on this GPU, in ``dtype``: checked once per
    process, GPU and dtype; a mismatch or an error warns once and leaves the pieces one call
    each. Not checked while a CUDA graph is captured (the check allocates and copies from the
    host): ``False`` there, the pieces one call each, and asked again after the capture."""
    key = (device, dtype)
    with _CHECKING:  # rank threads of one process: one check, one warning
        if key not in _MATCHED:
            if _capturing():
                return False
            _MATCHED[key] = _check_kernel(device, dtype)
        return _MATCHED[key]


def forget_kernel_checks() -> None:
    """Drop :func:`kernel_matches_reference`'s answers (tests: check again)."""
    _MATCHED.clear()


def _check_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`kernel_matches_reference`, asked (autocast off: the reference computes in fp32
    whatever region the first forward runs in)."""
    with torch.autocast(device.type, enabled=False):
        return _compare_with_reference(device, dtype)


def _compare_with_reference(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = cols = 96
    q, dout = (torch.randn(1, 4, rows, 64, generator=gen).to(device, dtype) for _ in "qo")
    k, v = (torch.randn(1, 2, cols, 64, generator=gen).to(device, dtype) for _ in "kv")
    try:
        for call in _probe_calls():
            got = varlen_forward(q, k, v, call, 0.125)
            want = varlen_forward(q, k, v, call, 0.125, reference_forward)
            out = torch.zeros_like(q)  # the call's rows as the final output and LSE
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
            out[:, :, call.row_span], lse[:, :, call.row_span] = got
            back = (dout, q, k, v, out, lse, call, 0.125)
            got_back = varlen_backward(*back)
            want_back = varlen_backward(*back, reference_backward)
            pairs = [*zip(got, want), *zip(got_back, want_back)]
            if not all(_close(a, b) for a, b in pairs):
                raise AssertionError(f"call {call} differs from the reference")
    except Exception as error:  # noqa: BLE001 - any failure leaves the pieces path
        warnings.warn(f"FlashAttention-2's varlen kernel did not match the reference on "
                      f"{device} in {dtype} ({error}); packed blocks run their pieces one "
                      f"call each ({VARLEN_ENV}=off silences this)", RuntimeWarning,
                      stacklevel=2)
        return False
    return True

