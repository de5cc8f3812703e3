"""The CPU proxy of CP attention's GPU overhead: kernel launches per rank of one step.

A step is one :func:`~.api.context_parallel_attention` forward and its backward on this rank
(real groups, real communication). The caller hands in how a case's CP groups are made
(:data:`CPGroups`, e.g. :func:`megatron_hcp.parallel_state.groups.bare_cp_groups`): the
attention makes none. :func:`rank_launches` runs each :class:`LaunchCase` on the ranks of the
calling world and counts what it launched with :func:`~.launches.count_launches`; a GPU would
launch the same aten ops (the attention kernel differs by device, the rest does not). Counts
are a steady step: a warm-up step runs first, so what is built once per packing (layout
metadata, a window's trimming, a2a permutations) is not in them - a new packing's first layer
pays it once. ``tests/unit/attention/test_cp_attention.py`` holds the counts to a budget and
``benchmarks/attention.py --launches`` prints them (issue #34).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...sharding import get_local_chunk
from .api import context_parallel_attention
from .block_counter import BlockCounter
from .launches import LaunchCount, count_launches
from .pieces import splitting

__all__ = ["CASES", "CPGroups", "LaunchCase", "case_groups", "rank_launches"]


@dataclass(frozen=True)
class LaunchCase:
    """One CP attention configuration (global sequence ``seq``, causal, batch 1)."""

    name: str
    comm: str
    cp: int
    fmt: str = "bshd"
    heads: int = 8
    kv_heads: int = 8
    dim: int = 64
    dim_v: int | None = None
    window: tuple[int, int] | None = None
    mode: str = "zigzag"
    seq: int = 512
    dtype: torch.dtype = torch.float32
    sequences: int = 3  # thd: three packed sequences, or one (with padding at its end)
    split: str = "auto"  # MEGATRON_HCP_SPLIT_PACKED for the case (thd: pieces or masked)

    @property
    def hcp(self) -> tuple[int, int] | None:
        return (2, self.cp // 2) if self.comm == "a2a+p2p" else None


# every comm type, both layouts, thd (three sequences, or one: its tokens need no reordering;
# and computed per sequence, :mod:`.pieces`), GQA, MLA head dims, a sliding window and bf16
# (its conversions to and from the fp32 accumulators), at CP 2 and 4
CASES = (
    LaunchCase("p2p cp2", "p2p", 2),
    LaunchCase("p2p cp4", "p2p", 4),
    LaunchCase("p2p cp4 bf16", "p2p", 4, dtype=torch.bfloat16),
    LaunchCase("p2p cp4 contiguous", "p2p", 4, mode="contiguous"),
    LaunchCase("p2p cp4 thd", "p2p", 4, fmt="thd"),
    LaunchCase("p2p cp4 thd 1 seq", "p2p", 4, fmt="thd", sequences=1),
    LaunchCase("p2p cp4 thd pieces", "p2p", 4, fmt="thd", split="on"),
    LaunchCase("p2p cp4 gqa", "p2p", 4, kv_heads=2),
    LaunchCase("p2p cp4 mla", "p2p", 4, dim=96, dim_v=64),
    LaunchCase("p2p cp4 window", "p2p", 4, window=(64, 0)),
    LaunchCase("all_gather cp4", "all_gather", 4),
    LaunchCase("a2a cp4", "a2a", 4),
    LaunchCase("a2a+p2p cp4", "a2a+p2p", 4),
)


#: ``(cp_size, hcp_sizes or None) -> (this rank's CP group or its level groups, its position)``,
#: called on every rank in the same order
CPGroups = Callable[[int, "tuple[int, int] | None"], tuple[Any, int]]


def case_groups(case: LaunchCase, cp_groups: CPGroups, cache: dict) -> tuple[Any, int]:
    """This rank's CP group(s) for ``case`` and its CP position: ``cp_groups`` called once per
    (CP size, HCP sizes), in case order (the same on every rank)."""
    key = (case.cp, case.hcp)
    if key not in cache:
        cache[key] = cp_groups(case.cp, case.hcp)
    return cache[key]


def _inputs(case: LaunchCase, position: int, device: torch.device):
    """This rank's shards of q, k, v, dout and the thd metadata (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    dv = case.dim_v or case.dim
    meta: dict[str, torch.Tensor] = {}
    if case.fmt == "thd" and case.sequences == 1:  # one sequence, its last 8 tokens padding
        meta["cu_seqlens_q"] = torch.tensor([0, case.seq - 8], dtype=torch.int32,
                                            device=device)
        meta["cu_seqlens_q_padded"] = torch.tensor([0, case.seq], dtype=torch.int32,
                                                   device=device)
        lead: tuple[int, ...] = (case.seq,)
    elif case.fmt == "thd":  # three sequences, padded to the layout's unit
        lengths = [case.seq // 4, case.seq // 2, case.seq // 4]
        meta["cu_seqlens_q"] = meta["cu_seqlens_q_padded"] = torch.tensor(
            [0, lengths[0], lengths[0] + lengths[1], case.seq], dtype=torch.int32, device=device)
        lead = (case.seq,)
    else:
        lead = (1, case.seq)
    shapes = [(case.heads, case.dim), (case.kv_heads, case.dim), (case.kv_heads, dv),
              (case.heads, dv)]
    full = [torch.randn(*lead, *s, generator=gen).to(device, case.dtype) for s in shapes]
    pad = meta.get("cu_seqlens_q_padded")
    return [get_local_chunk(x, case.cp, position, case.fmt, pad, cp_partition_mode=case.mode)
            for x in full], meta


def rank_launches(cases: tuple[LaunchCase, ...] = CASES, device: str = "cpu",
                  fused: bool = False, *, cp_groups: CPGroups
                  ) -> list[tuple[LaunchCount, LaunchCount, int]]:
    """On every rank of the world: (forward, backward, forward blocks) of each case's step,
    on the groups ``cp_groups`` makes. Cases whose CP size does not divide the world are
    refused. ``fused``: every merge and mask
    counted as the kernels :mod:`.gpu.fused` is expected to launch for it on a GPU
    (:func:`~.launches.count_launches`); CPU only."""
    if fused and device != "cpu":
        raise ValueError(f"rank_launches(fused=True, device={device!r}): fused regions are "
                         "counted on the CPU only (on CUDA the backward runs on threads that do "
                         "not see the counter); use device='cpu'")
    world = dist.get_world_size()
    for case in cases:
        if world % case.cp:
            raise ValueError(f"case {case.name!r}: cp={case.cp} does not divide the world of "
                             f"{world} ranks; run it on a world of a multiple of {case.cp}")
    cache: dict = {}
    out = []
    for case in cases:
        group, position = case_groups(case, cp_groups, cache)
        (q, k, v, dout), meta = _inputs(case, position, torch.device(device))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        kwargs = dict(cp_comm_type=case.comm, cp_group=group, qkv_format=case.fmt,
                      window_size=case.window, cp_partition_mode=case.mode, **meta)
        with splitting(case.split):
            context_parallel_attention(q, k, v, **kwargs).backward(dout)  # warm-up
            with BlockCounter() as blocks:
                result, forward = count_launches(context_parallel_attention, q, k, v,
                                                 fused=fused, **kwargs)
            _, backward = count_launches(result.backward, dout, fused=fused)
        out.append((forward, backward, len(blocks.computed)))
    return out
