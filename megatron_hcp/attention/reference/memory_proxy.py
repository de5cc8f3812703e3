"""Memory per rank of one CP attention step, against one flash call on the rank's own tokens.

A step is one :func:`~.api.context_parallel_attention` forward and its backward on this rank
(real groups, real communication), counted by :func:`~.memory.measure_step` as a model runs
it: q, k and v are made inside the step and dropped after the forward, so what is alive then
is the output and what the autograd graph keeps. The baseline is :class:`LocalFlash` on the
same rank's tokens, measured the same way in the same run: one flash-attention call, which
keeps exactly q, k, v, the output and the LSE (Transformer Engine's and FlashAttention's saved
set) and recomputes the rest in its backward. A warm-up step runs first, so what the backend
builds once per packing (layout metadata, a2a permutations, a window's trimming) is not in the
counts. ``benchmarks/attention_memory.py`` prints the ratios and
``tests/unit/attention/test_attention_memory.py`` holds them to the targets.
:func:`rank_times` times the same steps against the same call (``benchmarks/attention_time.py``):
what a change to the memory costs or saves in time.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...sharding import get_local_chunk
from .api import context_parallel_attention
from .kernel_support import MATH, acc_dtype
from .kernels import block_backward, block_forward, choose_kernel
from .launch_proxy import CPGroups, case_groups
from .memory import StepMemory, measure_step

__all__ = ["MemoryCase", "LocalFlash", "case_step", "floor_bytes", "local_flash", "rank_memory",
           "rank_times"]


@dataclass(frozen=True)
class MemoryCase:
    """One CP attention configuration: global sequence ``seq`` (bshd: batch 1; thd:
    ``sequences`` packed sequences of equal length), causal."""

    name: str
    comm: str
    cp: int
    fmt: str = "bshd"
    heads: int = 8
    kv_heads: int = 8
    dim: int = 64
    dim_v: int | None = None
    window: tuple[int, int] | None = None
    seq: int = 2048
    dtype: torch.dtype = torch.float32
    sequences: int = 4

    @property
    def hcp(self) -> tuple[int, int] | None:
        return (2, self.cp // 2) if self.comm == "a2a+p2p" else None

    @property
    def a2a(self) -> int:
        """The a2a size (1 without an a2a level)."""
        return {"a2a": self.cp, "a2a+p2p": 2}.get(self.comm, 1)

    @property
    def kv_reps(self) -> int:
        """How many times the a2a level replicates each KV head (1: it is not wider than
        the KV heads)."""
        return max(1, self.a2a // self.kv_heads)


def floor_bytes(case: MemoryCase) -> dict[str, int]:
    """Per rank, what the kernels read again in backward, and the output: q, k, v (K/V at
    ``a2a / kv_heads`` times their size where an a2a level replicates KV heads), out and the
    fp32 LSE, in bytes."""
    tokens = case.seq // case.cp
    size = torch.empty((), dtype=case.dtype).element_size()
    dv = case.dim_v or case.dim
    reps = case.kv_reps
    return {"q": tokens * case.heads * case.dim * size,
            "k": reps * tokens * case.kv_heads * case.dim * size,
            "v": reps * tokens * case.kv_heads * dv * size,
            "out": tokens * case.heads * dv * size,
            "lse": tokens * case.heads * 4}


# the flash call's rows run in chunks where the CPU takes the math path (MLA head dims): its
# [B, H, rows, S] scores within a quarter of q's elements or 2^18, as CP attention's blocks
# (kernels.row_chunks); defined here, so that the baseline does not change with the code
# it measures
_SCORE_SHARE, _SCORE_ELEMENTS = 4, 2**18


def _flash_chunks(q: torch.Tensor, v: torch.Tensor) -> list[slice] | None:
    """Row chunks of the baseline's one causal block, or ``None`` (one kernel call)."""
    b, h, s, d = q.shape
    kernel = choose_kernel(q.device.type, q.dtype, d, v.shape[-1], s, s, causal=True,
                           masked=False, biased=False)
    if kernel.kernel != MATH:
        return None
    step = max(1, max(q.numel() // _SCORE_SHARE, _SCORE_ELEMENTS) // (b * h * s))
    return None if step >= s else [slice(i, min(i + step, s)) for i in range(0, s, step)]


def _causal_rows(rows: slice, cols: int, device: torch.device) -> torch.Tensor:
    """The causal mask of the query ``rows`` of a square block (booleans)."""
    return torch.ones(rows.stop - rows.start, cols, dtype=torch.bool, device=device).tril(
        rows.start)


class LocalFlash(torch.autograd.Function):
    """One flash-attention call, causal, on q [B,H,S,D], k/v [B,Hkv,S,D|Dv]: the project's
    block kernel on the whole block (the CPU flash kernel, one call), saving exactly q, k, v,
    out and LSE. Where the kernel is the math path (MLA head dims on the CPU) its rows run in
    chunks (:func:`_flash_chunks`), dK/dV summed over them. A window does not change a flash
    call's memory (flash kernels compute it without a mask): the causal call is the baseline
    of windowed cases too."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        chunks = _flash_chunks(q, v)
        if chunks is None:
            out, lse = block_forward(q, k, v, scale=scale, causal=True)
        else:
            acc = acc_dtype(q.dtype)
            out = q.new_empty((*q.shape[:3], v.shape[-1]), dtype=acc)
            lse = q.new_empty(q.shape[:3], dtype=acc)
            for rows in chunks:
                out[:, :, rows], lse[:, :, rows] = block_forward(
                    q[:, :, rows], k, v, scale=scale,
                    mask=_causal_rows(rows, k.shape[2], q.device))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.chunks = scale, chunks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.chunks is None:
            dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=ctx.scale, causal=True)
        else:
            acc = acc_dtype(q.dtype)
            dq = q.new_empty(q.shape, dtype=acc)
            dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
            for rows in ctx.chunks:
                gq, gk, gv = block_backward(
                    dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                    scale=ctx.scale, mask=_causal_rows(rows, k.shape[2], q.device))
                dq[:, :, rows] = gq
                dk.add_(gk)
                dv.add_(gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def local_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:class:`LocalFlash` on bshd tensors [B, S, H, D] (thd [T, H, D]: one sequence)."""
    thd = q.dim() == 3
    q, k, v = ((t.unsqueeze(0) if thd else t).transpose(1, 2) for t in (q, k, v))
    out = LocalFlash.apply(q, k, v, q.shape[-1] ** -0.5).transpose(1, 2)
    return out.squeeze(0) if thd else out


def _inputs(case: MemoryCase, position: int, device: torch.device):
    """This rank's shards of q, k, v, dout (leaves) and the thd metadata (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    dv = case.dim_v or case.dim
    meta: dict[str, torch.Tensor] = {}
    lead: tuple[int, ...] = (1, case.seq)
    if case.fmt == "thd":
        n = case.sequences
        cu = torch.tensor([case.seq * i // n for i in range(n + 1)], dtype=torch.int32)
        meta = {"cu_seqlens_q": cu.to(device), "cu_seqlens_q_padded": cu.to(device)}
        lead = (case.seq,)
    shapes = [(case.heads, case.dim), (case.kv_heads, case.dim), (case.kv_heads, dv),
              (case.heads, dv)]
    full = [torch.randn(*lead, *s, generator=gen).to(device, case.dtype) for s in shapes]
    pad = meta.get("cu_seqlens_q_padded")
    shards = [get_local_chunk(x, case.cp, position, case.fmt, pad).contiguous()
              for x in full]
    return shards, meta


def case_step(case: MemoryCase, cp_groups: CPGroups, cache: dict, device: str = "cpu"
              ) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """This rank's step of ``case``: q, k, v as leaves that require grad, the output's
    gradient and the keyword arguments of :func:`~.api.context_parallel_attention` (its groups
    from ``cp_groups``, :func:`~.launch_proxy.case_groups`, and the thd metadata)."""
    group, position = case_groups(case, cp_groups, cache)
    (q, k, v, dout), meta = _inputs(case, position, torch.device(device))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    kwargs = dict(cp_comm_type=case.comm, cp_group=group, qkv_format=case.fmt,
                  window_size=case.window, **meta)
    return leaves, dout, kwargs


def rank_memory(cases: tuple[MemoryCase, ...], device: str = "cpu", *, cp_groups: CPGroups
                ) -> list[tuple[StepMemory, StepMemory, StepMemory | None]]:
    """On every rank of the world, for each case: (CP step, :class:`LocalFlash` step, the
    floor's step), counted by :func:`~.memory.measure_step` after a warm-up step, on the
    groups ``cp_groups`` makes (:func:`~.launch_proxy.case_groups`). The floor's step is
    ``None`` unless the case's a2a level replicates KV heads (:attr:`MemoryCase.kv_reps` >
    1): then one :class:`LocalFlash` step on the rank's q and its K/V as the CP kernels read
    them - each KV head ``kv_reps`` times, the bytes of the whole-sequence KV head an a2a
    rank attends with. Such an a2a cannot hold less than that call: it is the baseline of its
    peak target, as ``floor_bytes`` is of its kept target. Cases whose CP size does not
    divide the world are refused."""
    world = dist.get_world_size()
    for case in cases:
        if world % case.cp:
            raise ValueError(f"case {case.name!r}: cp={case.cp} does not divide the world of "
                             f"{world} ranks; run it on a world of a multiple of {case.cp}")
    cache: dict = {}
    out = []
    for case in cases:
        leaves, dout, kwargs = case_step(case, cp_groups, cache, device)

        def cp_step(*qkv: torch.Tensor, kwargs=kwargs) -> torch.Tensor:
            return context_parallel_attention(*qkv, **kwargs)

        cp_step(*leaves).backward(dout)  # warm-up: per-packing metadata, permutations
        local_flash(*leaves).backward(dout)
        gc.collect()
        cp = measure_step(cp_step, leaves, dout)
        flash = measure_step(local_flash, leaves, dout)
        out.append((cp, flash, _floor_step(case, leaves, dout)))
    return out


def _floor_step(case: MemoryCase, leaves: list[torch.Tensor], dout: torch.Tensor
                ) -> StepMemory | None:
    """:func:`rank_memory`'s floor step of ``case`` on this rank's q, k, v ``leaves``."""
    if case.kv_reps == 1:
        return None
    q, k, v = leaves
    replicated = [q.detach().requires_grad_()] + [
        x.detach().repeat_interleave(case.kv_reps, dim=-2).requires_grad_() for x in (k, v)]
    local_flash(*replicated).backward(dout)  # warm-up
    gc.collect()
    return measure_step(local_flash, replicated, dout)


def rank_times(cases: tuple[MemoryCase, ...], repeats: int = 3, *, cp_groups: CPGroups
               ) -> list[tuple[float, float]]:
    """On every rank: (CP step, :class:`LocalFlash` step) seconds of each case, forward and
    backward, the best of ``repeats`` after a warm-up step; a CP step is timed from a barrier
    to a barrier of the world (its slowest rank: run it on a world of the cases' CP size)."""
    cache: dict = {}
    out = []
    for case in cases:
        leaves, dout, kwargs = case_step(case, cp_groups, cache)
        out.append((_best(repeats, True, context_parallel_attention, leaves, dout, kwargs),
                    _best(repeats, False, local_flash, leaves, dout, {})))
    return out


def _best(repeats: int, fenced: bool, step, leaves, dout, kwargs) -> float:
    """Seconds of ``step(*leaves, **kwargs)`` and its backward, best of ``repeats`` after a
    warm-up (``fenced``: from a barrier to a barrier of the world, else this rank alone)."""
    times = []
    for _ in range(repeats + 1):
        if fenced:
            dist.barrier()
        start = time.perf_counter()
        step(*leaves, **kwargs).backward(dout)
        if fenced:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times[1:])
