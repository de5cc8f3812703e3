"""Dynamic-CP process groups: aligned power-of-two blocks of every DPxCP group, by size.

For a DPxCP group of ``N`` ranks and every power of two ``c`` from the minimum dynamic CP size up
to ``N``, the ranks are cut into contiguous aligned blocks of ``c`` (the arithmetic of
:attr:`megatron_hcp.config.Topology.dynamic_blocks`). Size ``N`` is the DPxCP group
itself and size 1 is "no CP" (no group, megatron's ``local_cp_size == 1`` convention), so only
sizes strictly between are created. Creation is collective over the whole world and runs in
the same order on every rank; a warm-up all-reduce on each new group makes a broken group fail
at start-up instead of inside the first training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config.topology import dynamic_cp_blocks, dynamic_hcp_levels
from .groups import collective_device, destroy_groups, group_kwargs

__all__ = ["DynamicCPGroups", "create_dynamic_cp_groups",
           "dynamic_cp_groups_of"]


@dataclass
class DynamicCPGroups:
    """This rank's dynamic CP groups.

    ``dp_cp_ranks`` are the global ranks of this rank's DPxCP group in group order (positions in
    a dynamic-CP plan index this list); ``by_size`` maps a size to this rank's group of that
    size (1 -> None, ``len(dp_cp_ranks)`` -> the DPxCP group).
    """

    dp_cp_ranks: list[int]
    by_size: dict[int, Any]
    min_size: int = 1
    created: list[Any] = field(default_factory=list, repr=False)
    # dynamic hierarchical CP: the a2a level size, this rank's a2a group (its aligned block of
    # a2a_size ranks) and, per dynamic size above a2a_size, its p2p ring
    a2a_size: int | None = None
    a2a_group: Any = None
    p2p_by_size: dict[int, Any] = field(default_factory=dict)

    def levels(self, size: int) -> list[Any] | None:
        """``[a2a_group, p2p_group]`` of this rank's dynamic group of ``size`` ranks under
        dynamic hierarchical CP; None when the group is flat (no HCP, or ``size <= a2a``: pure
        a2a over the group itself)."""
        if self.a2a_size is None or size <= self.a2a_size:
            return None
        if size not in self.p2p_by_size:
            raise ValueError(f"no dynamic hierarchical levels for a group of {size} ranks: "
                             f"sizes are {sorted(self.p2p_by_size)}")
        return [self.a2a_group, self.p2p_by_size[size]]

    @property
    def size(self) -> int:
        return len(self.dp_cp_ranks)

    @property
    def position(self) -> int:
        """This rank's position in its DPxCP group."""
        return self.dp_cp_ranks.index(dist.get_rank())

    def group(self, size: int) -> Any:
        """This rank's group of ``size`` ranks (None for 1)."""
        if size not in self.by_size:
            raise ValueError(
                f"no dynamic CP group of size {size}: sizes are {sorted(self.by_size)} "
                f"(powers of two from min_dynamic_context_parallel_size={self.min_size} up to "
                f"DPxCP={self.size})"
            )
        return self.by_size[size]

    def destroy(self) -> None:
        """Destroy the groups this object created (never the DPxCP group it was given)."""
        destroy_groups(self.created)
        self.created.clear()
        self.by_size.clear()
        self.p2p_by_size.clear()
        self.a2a_group = None


def create_dynamic_cp_groups(
    all_dp_cp_ranks: Sequence[Sequence[int]],
    dp_cp_group: Any,
    min_size: int = 1,
    *,
    new_group: Callable[..., Any] | None = None,
    timeout: Any = None,
    pg_options: Any = None,
    warm_up: bool = True,
    agreement_timeout: Any = None,
    a2a_size: int | None = None,
) -> DynamicCPGroups:
    """Create the dynamic CP groups of every DPxCP group (collective over the whole world).

    ``all_dp_cp_ranks`` lists every DPxCP group of the world (the same list on all ranks);
    ``dp_cp_group`` is this rank's DPxCP process group (used for size ``N``). ``new_group``
    defaults to ``torch.distributed.new_group`` (the MPU layer passes megatron's
    ``create_group`` so that megatron's destroy sees the groups). Before any group is created
    all ranks agree on the rank lists and ``min_size``
    (:func:`~megatron_hcp.parallel_state.agreement.agree`, bounded by ``agreement_timeout``).

    ``a2a_size`` (dynamic hierarchical CP): every dynamic group of more than ``a2a_size`` ranks
    also gets its levels (:func:`~megatron_hcp.config.topology.dynamic_hcp_levels`): the a2a
    level is the aligned block of ``a2a_size`` ranks (one group per rank, shared by every
    size), the p2p level one ring per size.
    """
    from .agreement import agree

    agree({"all_dp_cp_ranks": [[int(r) for r in ranks] for ranks in all_dp_cp_ranks],
           "min_dynamic_context_parallel_size": min_size, "a2a_size": a2a_size},
          what="dynamic CP groups", tag="dynamic_cp", timeout=agreement_timeout)
    make = new_group or dist.new_group
    rank = dist.get_rank()
    kwargs = group_kwargs(timeout, pg_options)
    mine: list[int] | None = None
    by_size: dict[int, Any] = {}
    created: list[Any] = []
    for ranks in all_dp_cp_ranks:
        ranks = [int(r) for r in ranks]
        blocks = dynamic_cp_blocks(ranks, min_size)
        n = len(ranks)
        if rank in ranks:
            mine = ranks
            by_size[n] = dp_cp_group
            if 1 in blocks:
                by_size[1] = None
        for size in sorted(blocks):
            if size in (1, n):
                continue
            for block in blocks[size]:
                group = make(ranks=block, group_desc=f"DYNAMIC_CP_GROUP_{size}", **kwargs)
                if rank in block:
                    by_size[size] = group
                    created.append(group)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the DPxCP groups {list(all_dp_cp_ranks)}")
    a2a_group, p2p_by_size = None, {}
    if a2a_size is not None:
        a2a_group, p2p_by_size = _create_levels(all_dp_cp_ranks, min_size, a2a_size, by_size,
                                                created, make, kwargs)
    if dp_cp_group is not None and sorted(dist.get_process_group_ranks(dp_cp_group)) != sorted(
            mine):
        raise ValueError(
            f"dp_cp_group has ranks {dist.get_process_group_ranks(dp_cp_group)} but this rank's "
            f"DPxCP group in all_dp_cp_ranks is {mine}"
        )
    if warm_up:
        for size in sorted(by_size):
            group = by_size[size]
            if group is None:
                continue
            probe = torch.ones(1, device=collective_device(group))
            dist.all_reduce(probe, group=group)
            if int(probe.item()) != size:
                raise RuntimeError(
                    f"warm-up all_reduce over the dynamic CP group of size {size} returned "
                    f"{int(probe.item())}"
                )
        for size, group in sorted(p2p_by_size.items()):
            probe = torch.ones(1, device=collective_device(group))
            dist.all_reduce(probe, group=group)
            if int(probe.item()) != size // a2a_size:
                raise RuntimeError(f"warm-up all_reduce over the p2p level of size {size} "
                                   f"returned {int(probe.item())}")
    return DynamicCPGroups(mine, by_size, min_size, created, a2a_size, a2a_group, p2p_by_size)


def _create_levels(all_dp_cp_ranks, min_size, a2a_size, by_size, created, make, kwargs):
    """This rank's a2a level group and its p2p ring per dynamic size (collective: every rank
    creates every group in the same order)."""
    rank = dist.get_rank()
    a2a_group = by_size.get(a2a_size) if a2a_size >= min_size else None
    p2p_by_size: dict[int, Any] = {}
    for ranks in all_dp_cp_ranks:
        ranks = [int(r) for r in ranks]
        blocks = dynamic_cp_blocks(ranks, min_size)
        if a2a_size < min_size:  # the a2a blocks are no dynamic size of their own
            for block in dynamic_cp_blocks(ranks, a2a_size)[a2a_size]:
                group = make(ranks=block, group_desc=f"DYNAMIC_HCP_A2A_{a2a_size}", **kwargs)
                if rank in block:
                    a2a_group = group
                    created.append(group)
        for size in sorted(s for s in blocks if s > a2a_size):
            for block in blocks[size]:
                _, rings = dynamic_hcp_levels(block, a2a_size)
                for ring in rings:
                    group = make(ranks=ring, group_desc=f"DYNAMIC_HCP_P2P_{size}", **kwargs)
                    if rank in ring:
                        p2p_by_size[size] = group
                        created.append(group)
    return a2a_group, p2p_by_size


def dynamic_cp_groups_of(pg_collection: Any) -> DynamicCPGroups | None:
    """The dynamic CP groups of a collection megatron-hcp returned (the typed ``dynamic_cp`` of
    :class:`~.pg_collection.HCPProcessGroupCollection`); None: none, or another collection."""
    groups = getattr(pg_collection, "dynamic_cp", None)
    return groups if isinstance(groups, DynamicCPGroups) else None
