"""Process groups for the levels of hierarchical CP, built from :mod:`.layout`."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .layout import Groups, hierarchical_level_groups

__all__ = ["create_hierarchical_groups", "new_groups"]


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
        kwargs: dict[str, Any] = {"ranks": ranks, "backend": backend, "pg_options": pg_options}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if group_desc is not None:
            kwargs["group_desc"] = group_desc
        group = dist.new_group(**kwargs)
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
