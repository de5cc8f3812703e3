"""Which CP group(s) a core-attention call uses: one pure decision for TE and the reference path.

Order of precedence:

1. dynamic CP: ``packed_seq_params.local_cp_size`` / ``packed_seq_params.cp_group`` set by the
   dynamic-CP data path for this micro-batch (``local_cp_size == 1`` means no CP for it);
2. ``a2a+p2p``: ``pg_collection.hcp`` (never megatron's global hierarchical groups);
3. otherwise ``pg_collection.cp``.

A configuration with CP > 1 that would end up running without a CP group raises
:class:`SilentCPOffError` instead of silently attending only to the local chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..config import comm_type_or_default

__all__ = ["CPGroups", "SilentCPOffError", "micro_batch_cp_group", "mpu_pg_collection",
           "resolve_cp_groups", "te_cp_kwargs", "uses_dynamic_cp"]


class SilentCPOffError(RuntimeError):
    """CP is configured but the attention would run with CP off (wrong gradients)."""


@dataclass(frozen=True)
class CPGroups:
    """The CP setup of one attention call.

    ``group`` is a process group, or ``[a2a_group, p2p_group]`` for ``a2a+p2p``; ``flat_group`` is
    the flat CP group (its rank order is every rank's CP position); ``size`` 1 means no CP.
    """

    comm_type: str
    group: Any
    flat_group: Any
    size: int
    dynamic: bool = False

    @property
    def enabled(self) -> bool:
        return self.size > 1


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def uses_dynamic_cp(packed_seq_params: Any) -> bool:
    """The micro-batch brings its own CP group (dynamic CP): ``local_cp_size`` or ``cp_group``
    of ``packed_seq_params`` is set."""
    return packed_seq_params is not None and (
        getattr(packed_seq_params, "local_cp_size", None) is not None
        or getattr(packed_seq_params, "cp_group", None) is not None
    )


def micro_batch_cp_group(packed_seq_params: Any) -> tuple[bool, Any]:
    """(dynamic?, the micro-batch's own CP group) of a micro-batch; group None with dynamic True
    means no CP for it (``local_cp_size == 1``). Inconsistent fields raise
    :class:`SilentCPOffError` (never a silent fallback to the static group)."""
    if not uses_dynamic_cp(packed_seq_params):
        return False, None
    local = getattr(packed_seq_params, "local_cp_size", None)
    group = getattr(packed_seq_params, "cp_group", None)
    if group is None:
        if local == 1:
            return True, None
        raise SilentCPOffError(
            f"packed_seq_params.local_cp_size={local} but packed_seq_params.cp_group is None: "
            "dynamic CP must hand over the micro-batch's CP group (local_cp_size 1 alone "
            "means no CP)"
        )
    size = _size(group)
    if local is not None and local != size:
        raise SilentCPOffError(
            f"packed_seq_params.local_cp_size={local} but its cp_group has {size} ranks"
        )
    return True, group


def mpu_pg_collection():
    """megatron's MPU groups (tp, cp, hcp) as a ProcessGroupCollection, without asserting they
    exist (the default of modules built without a collection)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=ps.get_tensor_model_parallel_group(check_initialized=False),
        cp=ps.get_context_parallel_group(check_initialized=False),
        hcp=ps.get_hierarchical_context_parallel_groups(check_initialized=False),
    )


def resolve_cp_groups(
    context_parallel_size: int,
    cp_comm_type: str | None,
    pg_collection: Any,
    packed_seq_params: Any = None,
) -> CPGroups:
    """Decide the CP groups of one attention call; see the module docstring."""
    comm = comm_type_or_default(cp_comm_type)
    dynamic, dyn_group = micro_batch_cp_group(packed_seq_params)
    if dynamic:
        if dyn_group is None:
            return CPGroups(comm, None, None, 1, dynamic=True)
        size = _size(dyn_group)
        if comm != "a2a+p2p":
            return CPGroups(comm, dyn_group, dyn_group, size, dynamic=True)
        # dynamic hierarchical CP: the micro-batch's [a2a, p2p] levels, or none when its group
        # fits in the a2a level (pure a2a over the group)
        levels = getattr(packed_seq_params, "hierarchical_cp_groups", None)
        if levels is None:
            return CPGroups("a2a", dyn_group, dyn_group, size, dynamic=True)
        if len(levels) != 2 or _size(levels[0]) * _size(levels[1]) != size:
            raise SilentCPOffError(
                f"packed_seq_params.hierarchical_cp_groups span "
                f"{[_size(g) for g in levels]} ranks but the micro-batch's group has {size}")
        return CPGroups(comm, list(levels), dyn_group, size, dynamic=True)

    if context_parallel_size <= 1:
        return CPGroups(comm, None, None, 1)
    flat = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if comm == "a2a+p2p":
        hcp = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
        if not hcp or len(hcp) != 2 or any(g is None for g in hcp):
            raise SilentCPOffError(
                f"cp_comm_type=a2a+p2p with context_parallel_size={context_parallel_size} but "
                f"pg_collection.hcp is {hcp!r}: the hierarchical CP groups [a2a, p2p] are "
                "missing, so attention would run with CP off. Build them with "
                "megatron_hcp.parallel_state (MPU path) or megatron_hcp.bridge.create_pg_collection"
            )
        size = _size(hcp[0]) * _size(hcp[1])
        if size != context_parallel_size:
            raise SilentCPOffError(
                f"pg_collection.hcp spans {size} ranks but context_parallel_size="
                f"{context_parallel_size}"
            )
        return CPGroups(comm, list(hcp), flat, size)
    if flat is None:
        raise SilentCPOffError(
            f"context_parallel_size={context_parallel_size} but pg_collection.cp is missing: "
            "attention would run with CP off. Initialize the CP groups before building the model"
        )
    size = _size(flat)
    if size != context_parallel_size:
        raise SilentCPOffError(
            f"pg_collection.cp has {size} ranks but context_parallel_size={context_parallel_size}"
        )
    return CPGroups(comm, flat, flat, size)


def te_cp_kwargs(groups: CPGroups, cp_stream: Any) -> dict[str, Any]:
    """Arguments for TE's ``DotProductAttention.set_context_parallel_group``.

    TE takes the flat CP ranks as ``cp_global_ranks`` and, for a2a+p2p, the list of level
    groups as ``cp_group``. No CP: every field None (TE's own way of switching CP off).
    """
    if not groups.enabled:
        return {"cp_group": None, "cp_global_ranks": None, "cp_stream": None,
                "cp_comm_type": groups.comm_type}
    if groups.flat_group is None:
        raise SilentCPOffError(
            "Transformer Engine needs the flat CP group's ranks (cp_global_ranks) next to the "
            "hierarchical groups; pg_collection.cp is missing"
        )
    return {
        "cp_group": groups.group,
        "cp_global_ranks": dist.get_process_group_ranks(groups.flat_group),
        "cp_stream": cp_stream,
        "cp_comm_type": groups.comm_type,
    }
