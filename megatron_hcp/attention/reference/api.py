"""``context_parallel_attention``: CP attention over any torch.distributed backend.

Comm types (as in megatron-core / Transformer Engine):

* ``p2p`` - KV ring over the CP group, ``cp-1`` steps, load-balanced causal blocks;
* ``all_gather`` - one all-gather of KV (backward: reduce-scatter of dK/dV);
* ``a2a`` - Ulysses: all-to-all scatters heads and gathers the sequence, local attention, back;
* ``a2a+p2p`` - a2a inside the inner group, then a ring of ``p-1`` steps over the outer group.

The a2a output is re-ordered into the same two-halves layout one level up (chunks ``P*a..P*a+a-1``
and their mirrors), so a2a+p2p is an a2a followed by the p2p ring at CP size ``p``, and pure a2a
is the ring with ``p == 1``.

MLA shapes: ``v`` (and the output) may have a head dim other than q's and k's; the K/V ring
message and the all-to-alls carry each tensor at its own size.

GQA/MQA: KV heads may be fewer than query heads. When an a2a level is larger than the number of
KV heads (it must then be a multiple of it), KV heads are replicated ``a/Hkv`` times before the
all-to-all (as LoongTrain does). Cost: the K/V all-to-all and the post-a2a K/V buffers grow by
that factor, i.e. ``a/Hkv`` times the K/V memory of pure GQA; dK/dV of the replicas are summed.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...config import CP_COMM_TYPES
from ...sharding import (
    DEFAULT_CP_PARTITION_MODE,
    check_cu_seqlens_tensor,
    check_partition_mode,
    seq_lengths,
)
from .functions import AllGatherAttention, RingAttention
from .gpu import fused_mode, varlen_mode
from .packing import packing_lengths
from .pieces import split_mode
from .reorder import OutputOrder, TokenOrder, UlyssesAllToAll, pack_kv, run_starts
from .seq_layout import (
    CPAttentionError,
    SeqLayout,
    a2a_gather_permutation,
    half_grouping,
)

__all__ = ["check_window", "context_parallel_attention", "local_attention"]

Group = dist.ProcessGroup | None


def _to_bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return x.permute(0, 2, 1, 3)
    if fmt == "sbhd":
        return x.permute(1, 2, 0, 3)
    return x.permute(1, 0, 2).unsqueeze(0)


def _from_bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return x.permute(0, 2, 1, 3)
    if fmt == "sbhd":
        return x.permute(2, 0, 1, 3)
    return x.squeeze(0).permute(1, 0, 2)


def _groups(cp_comm_type: str, cp_group) -> tuple[Group, Group, int, int, int]:
    """(a2a group, ring group, a, p, flat position) for ``cp_comm_type``."""
    if cp_comm_type == "a2a+p2p":
        if not isinstance(cp_group, Sequence) or len(cp_group) != 2:
            raise CPAttentionError(
                "cp_comm_type='a2a+p2p' needs cp_group=[a2a_group, p2p_group] (megatron's "
                "hierarchical CP groups, innermost first); got "
                f"{type(cp_group).__name__}"
            )
        ga, gp = cp_group
        a, p = dist.get_world_size(ga), dist.get_world_size(gp)
        return ga, gp, a, p, dist.get_rank(gp) * a + dist.get_rank(ga)
    if isinstance(cp_group, Sequence):
        raise CPAttentionError(
            f"cp_comm_type={cp_comm_type!r} takes one cp_group, got a list of "
            f"{len(cp_group)}; pass a list only with a2a+p2p"
        )
    if cp_group is None:
        raise CPAttentionError(
            f"cp_group is None for cp_comm_type={cp_comm_type!r}: a missing group would run "
            "with CP off; pass the context-parallel process group"
        )
    n, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if cp_comm_type == "a2a":
        return cp_group, None, n, 1, r
    return None, cp_group, 1, n, r


def _check_heads(hq: int, hkv: int, a: int) -> None:
    if hkv < 1 or hq % hkv:
        raise CPAttentionError(
            f"{hq} query heads are not a multiple of {hkv} KV heads (GQA needs Hq % Hkv == 0)"
        )
    if a > 1 and hq % a:
        raise CPAttentionError(
            f"a2a size {a} does not divide the {hq} local query heads; use an a2a size that "
            "divides the heads (or a2a+p2p with a smaller a2a level)"
        )
    if a > 1 and hkv % a and a % hkv:
        raise CPAttentionError(
            f"a2a size {a} and {hkv} local KV heads: KV heads must be divisible by the a2a size "
            "or divide it (then they are replicated); use a smaller a2a level"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_comm_type: str,
    cp_group,
    causal: bool = True,
    qkv_format: str = "bshd",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    softmax_offset: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
) -> torch.Tensor:
    """Attention of this rank's CP shards ``q, k, v``; returns this rank's output shard.

    Shapes: ``bshd`` [b, s, h, d], ``sbhd`` [s, b, h, d], ``thd`` [t, h, d] (``v`` and the
    output may have their own head dim ``d_v``, as in MLA), with ``s``/``t`` the
    local (sharded) length as cut by :func:`~.sharding.get_local_chunk`. ``cp_group`` is one
    process group, or ``[a2a_group, p2p_group]`` for ``"a2a+p2p"``; a rank's CP position is its
    rank in the flat group (a2a+p2p: p2p index * a2a size + a2a index). For ``thd`` the
    ``cu_seqlens`` describe the full packed batch; missing kv metadata defaults to q's,
    ``cu_seqlens_q_padded`` to ``cu_seqlens_q``, and
    every padded length must be a multiple of ``2*CP``. Padding tokens get output 0 and no
    gradient. Self-attention only: q and kv share the packing. ``window_size=(left, right)``:
    sliding window (query at position i sees keys i-left .. i+right of its sequence, ``-1`` =
    unbounded, with ``causal`` also keys <= i), as Transformer Engine's ``window_size``.
    ``softmax_offset`` [h] (one per query head of ``q``): an extra logit per head in every
    row's softmax denominator (a "sink" key with value 0) - zeros for megatron's
    ``softmax_type="off-by-one"``, a parameter for ``"learnable"``. Its gradient on each rank
    covers that rank's rows (and, after a2a, its heads); summed over the CP group (as
    megatron's DDP sums gradients over DPxCP) it is the full gradient. ``attention_bias``: a
    post-scale bias over the *whole* sequence, ``[b|1, h|1, s|1, s]`` (TE's ``bhss``,
    ``1hss``, ``11ss``, ``111s``), added to the scaled scores; each block takes its rows and
    columns (the same load-balanced chunks as the scores). With CP only on the ring (``p2p``)
    and not with ``thd`` - as Transformer Engine; its gradient, like the offset's, covers this
    rank's rows and sums over the CP group. ``cp_partition_mode``: the layout the shards are
    in (:mod:`~megatron_hcp.sharding`): ``"zigzag"`` (chunks ``r`` and ``2*CP-1-r``; padded
    lengths a multiple of ``2*CP``) or ``"contiguous"`` (slice ``r``; a multiple of ``CP``),
    every comm type and feature in both; the output is in the same layout.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise CPAttentionError(f"cp_comm_type={cp_comm_type!r}: use one of {CP_COMM_TYPES}")
    mode = check_partition_mode(cp_partition_mode)
    window = check_window(window_size)
    return _attention(
        q, k, v, cp_comm_type, _groups(cp_comm_type, cp_group), causal, qkv_format,
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, softmax_scale,
        window, softmax_offset, attention_bias, mode,
    )


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    qkv_format: str = "bshd",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    softmax_offset: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention without CP (one rank holds whole sequences); no communication.

    Packed (``thd``) sequences need no CP padding here: a sequence of odd padded length gets
    one masked token appended internally (the kernels split every sequence in two halves), and
    the output keeps the input's tokens only.
    """
    _check_tensors(q, k, v, softmax_scale)
    _check_packing_tensors(qkv_format, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                           cu_seqlens_q_padded=cu_seqlens_q_padded,
                           cu_seqlens_kv_padded=cu_seqlens_kv_padded)
    if qkv_format == "thd" and cu_seqlens_q is not None:
        padded = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        padded_kv = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
        if padded_kv is None or torch.equal(padded.cpu(), padded_kv.cpu()):
            index, even = _even_thd_layout(padded)
            if index is not None:
                grow = functools.partial(_scatter_rows, index=index, rows=int(even[-1]))
                out = _attention(
                    grow(q), grow(k), grow(v), "p2p", (None, None, 1, 1, 0), causal, "thd",
                    cu_seqlens_q, cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q,
                    even, even, softmax_scale, check_window(window_size), softmax_offset,
                    attention_bias)
                return out.index_select(0, index.to(out.device))
    return _attention(
        q, k, v, "p2p", (None, None, 1, 1, 0), causal, qkv_format,
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, softmax_scale,
        check_window(window_size), softmax_offset, attention_bias,
    )


def _check_packing_tensors(qkv_format: str, **cu_seqlens: torch.Tensor | None) -> None:
    """Every ``cu_seqlens`` given with ``thd`` checked as a tensor before anything reads it
    (:func:`~megatron_hcp.sharding.check_cu_seqlens_tensor`; its values are checked where they
    are read on the host, once per packing: :mod:`.packing`)."""
    if qkv_format == "thd":
        for name, cu in cu_seqlens.items():
            if cu is not None:
                check_cu_seqlens_tensor(cu, name)


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale) -> None:
    """q, k, v are floating tensors of one dtype with head dims >= 1, and the
    softmax scale (where given) a finite number > 0: anything else fails deep inside a kernel
    or returns NaN."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise CPAttentionError(f"{name} is {kind}: q, k and v must be floating-point "
                                   "tensors")
        if t.dim() and t.shape[-1] < 1:
            raise CPAttentionError(f"{name} has head dim {t.shape[-1]} ({list(t.shape)}): "
                                   "must be >= 1")
    if not q.dtype == k.dtype == v.dtype:  # (a device mix is the device audit's to locate)
        raise CPAttentionError(
            f"q, k, v are {q.dtype}/{k.dtype}/{v.dtype}: they must share one dtype (cast them, "
            "as the model's projection does)")
    if softmax_scale is not None and (
            isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise CPAttentionError(f"softmax_scale={softmax_scale!r}: must be a finite number > 0 "
                               "(None: 1/sqrt(head dim)); 0, a negative or NaN scale gives NaN "
                               "or meaningless attention")


def _even_thd_layout(cu_padded: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Rows of the tokens in a layout whose sequences have even lengths (None: already even)
    and that layout's cumulative lengths."""
    lengths = seq_lengths(cu_padded)
    if not any(n % 2 for n in lengths):
        return None, cu_padded
    even = [n + n % 2 for n in lengths]
    starts = [0]
    for n in even:
        starts.append(starts[-1] + n)
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    return index, torch.tensor(starts, dtype=cu_padded.dtype, device=cu_padded.device)


def _scatter_rows(t: torch.Tensor, *, index: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_zeros(rows, *t.shape[1:])
    return out.index_copy(0, index.to(t.device), t)


@functools.lru_cache(maxsize=16)
def _a2a_permutations(layout: SeqLayout, a: int, grouped: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The a2a gather permutation of ``layout`` and its inverse, on the layout's device: built
    once per packing, not per call (every layer of a step and its backward share them; on a
    GPU each build is host work and a copy to the device). ``grouped``: followed by the
    half grouping of the layout one level up (one gather does both)."""
    perm = a2a_gather_permutation(layout, a)
    if grouped:
        perm = perm[half_grouping(layout.padded, layout.cp // a)]
    perm = perm.to(layout.device)
    return perm, torch.argsort(perm)


@functools.lru_cache(maxsize=16)
def _grouping(layout: SeqLayout) -> OutputOrder:
    """How the output of :func:`~.seq_layout.half_grouping` order leaves (its inverse) and
    comes back (the grouping, also on the host with its runs: the backward's
    :class:`~.reorder.RowsInOrder` takes views of them), on the layout's device, once per
    packing."""
    host = half_grouping(layout.padded, layout.cp)
    perm = host.to(layout.device)
    return OutputOrder("tokens", torch.argsort(perm), perm, inv_host=tuple(host.tolist()),
                       inv_runs=run_starts(host))


def _check_bias(bias, cp_comm_type: str, qkv_format: str, qh: torch.Tensor, n: int) -> None:
    """A post-scale bias runs where Transformer Engine runs it with CP: the ring, not thd."""
    if bias is None:
        return
    if qkv_format == "thd":
        raise CPAttentionError(
            "attention_bias with qkv_format='thd': a bias over packed sequences has no defined "
            "layout (Transformer Engine has no bias with THD either); use bshd/sbhd or no bias")
    if cp_comm_type != "p2p":
        raise CPAttentionError(
            f"attention_bias with cp_comm_type={cp_comm_type!r}: the post-scale bias runs with "
            "CP on the ring only (cp_comm_type='p2p'), as in Transformer Engine")
    b, h, s = qh.shape[0], qh.shape[1], qh.shape[2] * n
    ok = (bias.dim() == 4 and bias.shape[0] in (1, b) and bias.shape[1] in (1, h)
          and bias.shape[2] in (1, s) and bias.shape[3] == s)
    if not ok:
        raise CPAttentionError(
            f"attention_bias has shape {list(bias.shape)}; it covers the whole sequence: "
            f"[{b} or 1, {h} or 1, {s} or 1, {s}] (bhss, 1hss, 11ss, 111s)")


def check_window(window_size) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)``, or ``None`` for no window (``None``/``(-1, -1)``)."""
    if window_size is None:
        return None
    ok = (isinstance(window_size, Sequence) and len(window_size) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1
                  for w in window_size))
    if not ok:
        raise CPAttentionError(
            f"window_size={window_size!r}: use (left, right) with ints >= -1 (-1 = unbounded), "
            "e.g. (128, 0), or None for no window"
        )
    left, right = window_size
    return None if (left, right) == (-1, -1) else (left, right)


def _attention(q, k, v, cp_comm_type, groups, causal, qkv_format, cu_seqlens_q, cu_seqlens_kv,
               cu_seqlens_q_padded, cu_seqlens_kv_padded, softmax_scale, window,
               softmax_offset=None, attention_bias=None,
               mode: str = DEFAULT_CP_PARTITION_MODE) -> torch.Tensor:
    if qkv_format not in ("bshd", "sbhd", "thd"):
        raise CPAttentionError(f"qkv_format={qkv_format!r}: use one of bshd, sbhd, thd")
    _check_tensors(q, k, v, softmax_scale)
    _check_packing_tensors(qkv_format, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                           cu_seqlens_q_padded=cu_seqlens_q_padded,
                           cu_seqlens_kv_padded=cu_seqlens_kv_padded)
    fused_mode()  # MEGATRON_HCP_FUSED_OPS, _SPLIT_PACKED and _VARLEN checked before any
    split_mode()  # communication
    varlen_mode()
    expected_dims = 3 if qkv_format == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != expected_dims:
            raise CPAttentionError(f"{name} has {t.dim()} dims; {qkv_format} needs {expected_dims}")
    a2a_group, ring_group, a, p, flat = groups
    n = a * p
    qh, kh, vh = (_to_bhsd(t, qkv_format) for t in (q, k, v))
    _check_bias(attention_bias, cp_comm_type if n > 1 else "p2p", qkv_format, qh, n)
    if not (qh.shape[2] == kh.shape[2] == vh.shape[2] and kh.shape[:2] == vh.shape[:2]):
        raise CPAttentionError(
            f"q, k, v disagree on sequence length or heads: {list(q.shape)}, {list(k.shape)}, "
            f"{list(v.shape)} (self-attention with one packing only)"
        )
    if qh.shape[-1] != kh.shape[-1]:
        raise CPAttentionError(
            f"q head dim {qh.shape[-1]} != k head dim {kh.shape[-1]}: q and k must share one "
            "head dim (only v may have its own, as in MLA's v_head_dim)"
        )
    _check_heads(qh.shape[1], kh.shape[1], a)
    sink = softmax_offset
    if sink is not None and (sink.dim() != 1 or sink.shape[0] != qh.shape[1]):
        raise CPAttentionError(
            f"softmax_offset has shape {list(sink.shape)}; it needs one value per query head "
            f"of q: [{qh.shape[1]}]")
    if qkv_format == "thd":
        if cu_seqlens_q is None:
            raise CPAttentionError("qkv_format='thd' needs cu_seqlens_q (full packed batch)")
        cu_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
        pad_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        pad_kv = pad_q if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
        # read on the host (on a GPU a synchronisation) and checked once per packing, not
        # per layer: packing.py
        padded, real = packing_lengths(cu_seqlens_q, cu_kv, pad_q, pad_kv, n, mode)
        layout = SeqLayout(padded, real, n, flat, mode, str(q.device))
        if layout.local_tokens != qh.shape[2]:
            raise CPAttentionError(
                f"q holds {qh.shape[2]} tokens but cu_seqlens_q_padded gives "
                f"{sum(padded)} / cp={n} = {layout.local_tokens} per rank; pass the "
                "sharded tensor (get_local_chunk) and the full-batch cu_seqlens"
            )
    else:
        if mode == "zigzag" and qh.shape[2] % 2:
            raise CPAttentionError(
                f"local sequence length {qh.shape[2]} is odd; the zigzag layout holds two equal "
                "chunks per rank (global length must be a multiple of 2*CP); pad it, or use "
                "cp_partition_mode='contiguous' (a multiple of CP)"
            )
        layout = SeqLayout.dense(qh.shape[2], n, flat, mode, str(q.device))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    # packed zigzag sequences: the attention holds the tokens with the halves grouped (every
    # block then takes slices, not gathered rows), ordered so once on the way in and back once
    # on the way out - inside the a2a's own gather where there is one
    grouped = layout.at(p, flat // a).groupable
    reorder = grouped and layout.grouping_moves_tokens  # one sequence: already in order
    # K and V travel and are kept as one tensor, their head dims side by side (one copy here,
    # which the ring's message, the all-gather's input or the a2a's send would need anyway)
    dim = kh.shape[-1]
    kvh = pack_kv(kh, vh)
    order = OutputOrder()
    if a > 1:
        # KV heads replicated where the a2a is wider, so every a2a rank gets the one it needs
        # (in the all-to-all's send buffer: no replicated copy beside it)
        reps = a // kvh.shape[1] if kvh.shape[1] % a else 1
        perm, inv = _a2a_permutations(layout, a, reorder)
        qh = UlyssesAllToAll.apply(qh, a2a_group, perm, inv, True)
        kvh = UlyssesAllToAll.apply(kvh, a2a_group, perm, inv, False, reps)
        order = OutputOrder("a2a", perm, inv, a2a_group)
        layout = layout.at(p, flat // a)
        if sink is not None:  # after the a2a this rank holds the heads of its a2a index
            sink = sink.view(a, -1)[dist.get_rank(a2a_group)]
    elif reorder:
        order = _grouping(layout)
        forth, back = order.inv, order.perm
        qh = TokenOrder.apply(qh, forth, back, True)
        kvh = TokenOrder.apply(kvh, forth, back, False)
    if grouped:
        layout = layout.with_grouped_halves()
    if cp_comm_type == "all_gather":
        out = AllGatherAttention.apply(qh, kvh, dim, layout, ring_group, causal, scale, window,
                                       sink, order)
    else:
        ranks = [0] if p == 1 else dist.get_process_group_ranks(ring_group)
        out = RingAttention.apply(qh, kvh, dim, layout, ring_group, ranks, causal, scale,
                                  window, sink, attention_bias, order)
    return _from_bhsd(out, qkv_format)
