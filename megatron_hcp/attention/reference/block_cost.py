"""The attention work of every CP rank, replayed on one device without communication and
timed against one ``scaled_dot_product_attention`` call on the whole sequence.

For CP size ``n`` each rank holds chunks ``r`` and ``2n-1-r`` of every sequence and runs, in
ring order, one block per source rank (:func:`~.blocks.plan_block`): the diagonal causal block
and ``n-1`` unmasked blocks on half of the queries or half of the keys. The replay runs exactly
those blocks through the backend's kernels (:func:`~.kernels.block_forward`, the LSE merge,
:func:`~.kernels.block_backward` with the final output and LSE), for every rank one after the
other, so the sum over ranks is the compute the CP backend spends on the problem. The baseline
is one SDPA forward + backward on the whole sequence (causal, the same dtype; torch's flash
kernel, or its efficient one where flash cannot run, e.g. fp32 on CUDA). ``ratio`` = replay /
baseline; issue #34's goal is <= 1.10 at CP <= 8, <= 1.25 at CP 16.

A sliding window makes the blocks masked (the fused kernels with an additive mask, those the
window sees nothing of skipped) or bands in FlashAttention-2's own window (:mod:`.gpu.varlen`).
Packed sequences (``lengths``) replay the blocks of packed ``thd`` data (halves grouped, as
the backend holds them), masked or in per-sequence pieces (:mod:`.pieces`). Their baseline is
the one flash call of the same work (:attr:`BlockCost.baseline`): where FlashAttention-2
takes the tensors and its kernel matched the reference (:func:`~.gpu.varlen.fa2_checked`: CUDA,
fp16/bf16, one head dim), one varlen call on the whole problem, its window FA2's own and
every packed sequence a segment; elsewhere one SDPA call with the window as an S x S mask
(torch's efficient kernel: flash takes no mask; up to ``MAX_WINDOW_BASELINE`` tokens), and one
SDPA call per packed sequence.

``fused``: how the replay runs its merges and masks (:mod:`.gpu.fused`: ``"off"`` eager,
``"auto"`` fused where Triton runs, ``"on"`` fused), so one run measures both;
:attr:`BlockCost.merges` and :attr:`BlockCost.masks` say which path they took.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...sharding import thd_partition_indices
from .block_counter import BlockCounter
from .blocks import plan_block
from .functions import _backward_block, _forward_block, _varlen
from .gpu import VarlenCall, fa2_checked, fusing, varlen_backward, varlen_forward, varlening
from .kernel_support import acc_dtype
from .kernels import expand_kv, reduce_kv
from .masks import Window
from .pieces import splitting
from .seq_layout import SeqLayout, half_grouping

__all__ = ["BaselineTooLarge", "BlockCost", "FLASH_VARLEN", "SDPA", "SDPA_PER_SEQUENCE",
           "band_mask", "baseline_call", "local_tokens", "measure_block_cost", "rank_block_pass"]

# the largest sequence whose windowed SDPA baseline (an S x S mask) is measured
MAX_WINDOW_BASELINE = 65536
# BlockCost.baseline: what the one-call time is of
SDPA = "sdpa"  # one scaled_dot_product_attention call (a window as an S x S mask)
SDPA_PER_SEQUENCE = "sdpa per sequence"  # packed sequences: one SDPA call each, summed
FLASH_VARLEN = "flash varlen"  # one FA2 varlen call: its own window, a segment per sequence


class BaselineTooLarge(ValueError):
    """A windowed problem whose only baseline here is an SDPA call with an S x S mask, and S is
    above :data:`MAX_WINDOW_BASELINE`."""


@dataclass(frozen=True)
class BlockCost:
    """One measurement: seconds (best of the repeats) and the kernels the blocks took."""

    cp: int
    blocks_s: float  # forward + backward of every rank's blocks, summed over the ranks
    sdpa_s: float  # one SDPA forward + backward on the whole sequence
    kernels: dict[tuple[str, str], int]  # forward kernel calls of one replay, (kernel, reason)
    blocks_per_rank: int
    merges: dict[str, int]  # LSE merges of one replay by path ("fused", "eager")
    masks: dict[str, int]  # additive masks of one replay (forward and backward) by path
    baseline: str = SDPA  # what sdpa_s timed: SDPA, SDPA_PER_SEQUENCE or FLASH_VARLEN

    @property
    def ratio(self) -> float:
        return self.blocks_s / self.sdpa_s


def rank_block_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    cp: int, rank: int, *, causal: bool = True, scale: float | None = None,
                    window: Window = None, lengths: tuple[int, ...] | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """Forward + backward of rank ``rank``'s CP blocks from global [B,H,S,D] tensors (K/V of
    every source already at hand; a sliding ``window``: masked blocks, those it sees nothing
    of skipped; ``lengths``: S packed sequences of these lengths, each a multiple of
    ``2*cp``, held with their halves grouped as the backend holds them - masked blocks, or
    their per-sequence pieces, :mod:`.pieces`); returns (out, dq, dk of every source, dv of
    every source) - the rank's output and its gradient contributions, in the accumulation
    dtype, its tokens in :func:`local_tokens` order."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = acc_dtype(q.dtype)
    if lengths is None:
        layout = SeqLayout.dense(q.shape[2] // cp, cp, rank, device=str(q.device))
    else:
        layout = SeqLayout(lengths, lengths, cp, rank, device=str(q.device))
        layout = layout.with_grouped_halves() if layout.groupable else layout

    def local(x, position):
        return x.index_select(2, local_tokens(x.shape[2], cp, position, lengths, x.device))

    q_r, dout_r = local(q, rank), local(dout, rank)
    kv = [(local(k, s), local(v, s)) for s in range(cp)]
    b, h, n, _ = q_r.shape
    # the backend's output layout: [B, S, H, Dv] in memory (functions._new_acc)
    out = torch.zeros(b, n, h, v.shape[-1], dtype=acc, device=q.device).permute(0, 2, 1, 3)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    order = [(rank - step) % cp for step in range(cp)]  # ring order
    varlen = _varlen(q_r, *kv[rank], layout, window)  # pieces as varlen calls (CUDA)
    blocks = [(src, plan_block(layout, layout.at(cp, src), causal, window, varlen=varlen))
              for src in order]
    blocks = [(src, block) for src, block in blocks if block is not None]
    for step, (src, block) in enumerate(blocks):
        _forward_block(q_r, *kv[src], block, scale, out, lse, first=step == 0, varlen=varlen)
    final = out.to(q.dtype)
    dq = torch.zeros(q_r.shape, dtype=acc, device=q.device)
    dk = [torch.zeros(kj.shape, dtype=acc, device=q.device) for kj, _ in kv]
    dv = [torch.zeros(vj.shape, dtype=acc, device=q.device) for _, vj in kv]
    for src, block in blocks:
        _backward_block(dout_r, q_r, *kv[src], final, lse, block, scale, dq, dk[src], dv[src],
                        varlen=varlen)
    return (out, dq, *dk, *dv)


def local_tokens(seq: int, cp: int, rank: int, lengths: tuple[int, ...] | None = None,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Global token indices of rank ``rank``'s tokens in the order :func:`rank_block_pass`
    holds them: chunks ``rank`` and ``2cp-1-rank`` of the sequence, or of every packed
    sequence of ``lengths`` - at CP > 1 with the halves grouped (every first half, then every
    second: :func:`~.seq_layout.half_grouping`), at CP 1 sequence by sequence."""
    lengths = lengths if lengths is not None else (seq,)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    ids = thd_partition_indices(cu, cp, rank)  # sequence by sequence
    return (ids[half_grouping(lengths, cp)] if cp > 1 else ids).to(device)


def band_mask(seq: int, causal: bool, window: Window, device: torch.device) -> torch.Tensor:
    """The [S, S] visible pairs of one sequence under ``causal`` and ``window`` (the one-call
    baseline's mask)."""
    gap = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)
    visible = gap >= 0 if causal else torch.ones_like(gap, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        visible &= gap <= left
    if right >= 0:
        visible &= -gap <= right
    return visible


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (kernel selection, allocator)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_block_cost(*, seq: int, heads: int, kv_heads: int, dim: int, cp: int,
                       dtype: torch.dtype, device: str | torch.device, batch: int = 1,
                       causal: bool = True, repeats: int = 3, seed: int = 0,
                       dim_v: int | None = None, window: Window = None,
                       fused: str = "auto", sdpa_s: float | None = None,
                       lengths: tuple[int, ...] | None = None, split: str = "auto",
                       varlen: str = "auto") -> BlockCost:
    """Time every rank's blocks (summed) and the one call of the same causal problem
    (``kv_heads < heads``: GQA; ``dim_v``: v's head dim where it differs, as in MLA; a sliding
    ``window``; ``lengths``: ``seq`` tokens packed as sequences of these lengths, each a
    multiple of ``2*cp``, no window) - the baseline of the module docstring. ``fused``,
    ``split``, ``varlen``: the modes the replay runs with (``MEGATRON_HCP_FUSED_OPS``,
    ``_SPLIT_PACKED``, ``_VARLEN``); ``sdpa_s``: the baseline time of this problem measured
    already (the other modes' row), not measured again. Raises :class:`BaselineTooLarge` for a
    window whose only baseline here is a mask of more than ``MAX_WINDOW_BASELINE`` squared."""
    device = torch.device(device)
    if lengths is not None and (window is not None or sum(lengths) != seq
                                or any(n % (2 * cp) for n in lengths)):
        raise ValueError(f"lengths={lengths}: packed sequences must sum to seq={seq}, each a "
                         f"multiple of 2*cp={2 * cp}, without a window")
    if seq % (2 * cp):
        raise ValueError(f"seq={seq}: must be a multiple of 2*cp={2 * cp} (two chunks per rank)")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    dv = dim if dim_v is None else dim_v
    shapes = ((heads, dim), (kv_heads, dim), (kv_heads, dv))
    flash = (window is not None or lengths is not None) and fa2_checked(
        *(torch.empty(batch, h, 8, d, device=device, dtype=dtype) for h, d in shapes))
    if window is not None and seq > MAX_WINDOW_BASELINE and not flash:
        raise BaselineTooLarge(
            f"seq={seq} with a window: FlashAttention-2 does not run here, and the SDPA "
            f"baseline's {seq} x {seq} mask is too large; use seq <= {MAX_WINDOW_BASELINE}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(h, d=dim):
        return torch.randn(batch, h, seq, d, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = draw(heads), draw(kv_heads), draw(kv_heads, dv), draw(heads, dv)

    def replay():
        for rank in range(cp):
            rank_block_pass(q, k, v, dout, cp, rank, causal=causal, window=window,
                            lengths=lengths)

    baseline = FLASH_VARLEN if flash else SDPA if lengths is None else SDPA_PER_SEQUENCE
    one_call = baseline_call(q, k, v, dout, causal=causal, window=window, lengths=lengths,
                             flash=flash)
    with torch.no_grad(), fusing(fused), splitting(split), varlening(varlen):
        blocks_s = _best(replay, repeats, device)
        with BlockCounter() as counter:
            replay()
    calls = sum(counter.kernels.values())
    return BlockCost(cp=cp, blocks_s=blocks_s,
                     sdpa_s=_best(one_call, repeats, device) if sdpa_s is None else sdpa_s,
                     kernels=dict(counter.kernels), blocks_per_rank=calls // cp,
                     merges=dict(counter.merges), masks=dict(counter.masks),
                     baseline=baseline)


Baseline = Callable[..., "tuple[torch.Tensor, ...] | None"]


def baseline_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                  causal: bool = True, window: Window = None,
                  lengths: tuple[int, ...] | None = None, flash: bool) -> Baseline:
    """The one call a replay is timed against, forward + backward on [B, H, S, D] tensors:
    ``flash``, one FlashAttention-2 varlen call (:func:`_one_flash_call`), else SDPA
    (:func:`_sdpa_calls`). Called with ``keep=True`` it returns (out, dq, dk, dv), so a test
    can check that both compute the same problem; timed, it returns nothing (no copies)."""
    return (_one_flash_call if flash else _sdpa_calls)(q, k, v, dout, causal, window, lengths)


def _sdpa_calls(q, k, v, dout, causal: bool, window: Window,
                lengths: tuple[int, ...] | None) -> Baseline:
    """SDPA forward + backward on the whole sequence (a window as an S x S mask), or on each
    packed sequence: torch's flash kernel, its efficient one where flash cannot run (fp32,
    MLA head dims, a mask); on the CPU, where neither takes MLA head dims, the math one."""
    seq = q.shape[2]
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if q.device.type != "cuda":
        backends.append(SDPBackend.MATH)
    band = None if window is None else band_mask(seq, causal, window, q.device)
    pieces = [slice(0, seq)] if lengths is None else [
        slice(start, start + n) for start, n in zip(itertools.accumulate((0, *lengths)), lengths)]
    kv_heads = k.shape[1]
    if band is not None:  # CUDA's efficient kernel (it takes the mask) has no enable_gqa:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])  # once, outside the timing

    def run(keep: bool = False):
        kept = []
        for part in pieces:
            qq, kk, vv = (t[:, :, part].detach().requires_grad_() for t in (q, k, v))
            with torch.enable_grad(), sdpa_kernel(backends):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=band, is_causal=causal and band is None,
                    enable_gqa=k.shape[1] != q.shape[1])
                out.backward(dout[:, :, part])
            if keep:
                dk, dv = (reduce_kv(t.grad, kv_heads) for t in (kk, vv))
                kept.append((out.detach(), qq.grad, dk, dv))
        return tuple(torch.cat(parts, dim=2) for parts in zip(*kept)) if keep else None
    return run


def _one_flash_call(q, k, v, dout, causal: bool, window: Window,
                    lengths: tuple[int, ...] | None) -> Baseline:
    """One FlashAttention-2 varlen forward + backward on the whole problem: every packed
    sequence a segment, a window FA2's own (on a square segment its bottom-right alignment
    is the diagonal's)."""
    lens = tuple(lengths) if lengths is not None else (q.shape[2],)
    total = sum(lens)
    call = VarlenCall(0, total, 0, total, lens, lens, causal,
                      window if window is not None else (-1, -1))
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run(keep: bool = False):
        out, lse = varlen_forward(q, k, v, call, scale)
        grads = varlen_backward(dout, q, k, v, out, lse, call, scale)
        return (out, *grads) if keep else None
    return run
