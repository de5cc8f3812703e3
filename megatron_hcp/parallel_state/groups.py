"""Create and destroy process groups from rank lists (:mod:`.layout`): plain groups, the levels
of hierarchical CP, the bare CP groups the attention's measuring proxies run on
(:func:`bare_cp_groups`), and the one place that turns optional group options into keyword
arguments."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config.topology import Groups, hierarchical_level_groups
from ..group_release import THREADED_BACKEND

__all__ = ["DefaultBackendDistributed", "bare_cp_groups", "collective_device",
           "create_hierarchical_groups", "destroy_groups", "group_kwargs", "new_groups"]


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: the current CUDA device for an
    NCCL group, the CPU otherwise (gloo). Every small collective of the project (probes, plans,
    lengths, checkpoints' agreement) allocates here, so the same code runs on gloo and NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_kwargs(timeout: timedelta | None = None, pg_options: Any = None,
                 **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``torch.distributed`` group creation: only the options given
    (``None`` leaves torch's default in place)."""
    out = {"timeout": timeout, "pg_options": pg_options, **extra}
    return {k: v for k, v in out.items() if v is not None}


def destroy_groups(groups: Any) -> None:
    """Destroy every live process group in ``groups`` (the default group is left alone).

    gloo keeps threads and sockets per group: groups that are only forgotten pile up and slow
    every later collective of the process. The groups of rank threads
    (:mod:`~megatron_hcp.harness.threaded_world`) hold nothing native and go with their world:
    torch's threaded registry cannot destroy one alone, so they are left to it.
    """
    from torch.distributed import distributed_c10d as c10d

    live = c10d._world.pg_map
    seen: set[int] = set()
    for group in groups:
        if group is None or id(group) in seen or group is c10d.GroupMember.WORLD:
            continue
        seen.add(id(group))
        if group in live and dist.get_backend(group) != THREADED_BACKEND:
            dist.destroy_process_group(group)


def new_groups(
    groups: Groups,
    *,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    backend: str | None = None,
    group_desc: str | None = None,
) -> dist.ProcessGroup | None:
    """Create one process group per rank list (every rank, same order); return this rank's."""
    rank = dist.get_rank()
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks=ranks, backend=backend,
                               **group_kwargs(timeout, pg_options, group_desc=group_desc))
        if rank in ranks:
            mine = group
    return mine


def create_hierarchical_groups(
    cp_groups: Groups,
    level_sizes: Sequence[int],
    *,
    timeout: timedelta | None = None,
    pg_options: Any | Sequence[Any] = None,
    backend: str | None = None,
    group_desc: str = "HIERARCHICAL_CONTEXT_PARALLEL_GROUP",
) -> list[dist.ProcessGroup]:
    """Build the hierarchical levels of every CP group; return this rank's group per level.

    ``cp_groups`` lists every CP group of the world (all ranks must pass the same list);
    ``pg_options`` may be one value or one per level. Level 0 is the a2a (inner) level.
    """
    per_cp = [hierarchical_level_groups(g, level_sizes) for g in cp_groups]
    options = (
        list(pg_options)
        if isinstance(pg_options, (list, tuple))
        else [pg_options] * len(level_sizes)
    )
    if len(options) != len(level_sizes):
        raise ValueError(
            f"pg_options has {len(options)} entries for {len(level_sizes)} hierarchical levels"
        )
    mine: list[dist.ProcessGroup] = []
    for level in range(len(level_sizes)):
        level_groups = [g for p in per_cp for g in p[level]]
        group = new_groups(
            level_groups,
            timeout=timeout,
            pg_options=options[level],
            backend=backend,
            group_desc=f"{group_desc}_L{level}",
        )
        if group is not None:
            mine.append(group)
    return mine


class DefaultBackendDistributed:
    """``torch.distributed`` as seen by a foreign group builder (e.g. Megatron-Bridge's
    decentralized path under the CPU runtime): subgroups it asks of a named backend (NCCL)
    are created on the default backend (gloo on the CPU) instead; everything else is
    ``torch.distributed`` itself."""

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def new_subgroups_by_enumeration(self, *args: Any, backend: Any = None, **kwargs: Any):
        return self._real.new_subgroups_by_enumeration(*args, **kwargs)


def bare_cp_groups(cp_size: int, hcp_sizes: Sequence[int] | None = None) -> tuple[Any, int]:
    """This rank's CP group - or its hierarchical level groups, a2a first, where ``hcp_sizes``
    is given - and its position in it, in a world of CP groups only (consecutive ranks,
    ``cp_size`` each): what the attention's measuring proxies and benchmarks run on. Every rank
    calls it with the same arguments in the same order (groups are made collectively)."""
    world = dist.get_world_size()
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"bare_cp_groups: cp_size={cp_size} must divide the world of {world} "
                         f"ranks; run on a world of a multiple of {cp_size}")
    flat = [list(range(start, start + cp_size)) for start in range(0, world, cp_size)]
    if hcp_sizes is None:
        return new_groups(flat), dist.get_rank() % cp_size
    return create_hierarchical_groups(flat, list(hcp_sizes)), dist.get_rank() % cp_size
