"""The thin integration with ``megatron.core.parallel_state`` (the MPU path).

This is the only module that sets megatron's global process groups: it validates the
:class:`~megatron_hcp.config.CPConfig` first (pure, so every rank raises the same error before any
collective), calls megatron's ``initialize_model_parallel``, checks that megatron's groups equal
:class:`~megatron_hcp.config.Topology` (``CPConfig.resolve``) on every rank with one small
all-gather, and logs the group lines on rank 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import CPConfig, Topology
from ..group_release import release_at_exit
from .agreement import agree_on_config
from .dynamic import DynamicCPGroups, create_dynamic_cp_groups
from .groups import collective_device, destroy_groups
from .report import describe_cp_groups

__all__ = [
    "LayoutMismatchError",
    "adopt_initialized_mpu",
    "destroy_model_parallel",
    "dynamic_cp_groups",
    "forget_stale_groups",
    "initialize_model_parallel",
    "megatron_memory_buffer",
    "mpu_groups_by_field",
]

logger = logging.getLogger("megatron_hcp")


class LayoutMismatchError(RuntimeError):
    """megatron-core's groups differ from the computed layout, or ranks disagree on it."""


def _layout_digest(layout: Topology) -> int:
    text = json.dumps(layout.to_json(), sort_keys=True)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _megatron_groups(ps: Any, layout: Topology) -> dict[str, list[int]]:
    ranks = dist.get_process_group_ranks
    found = {
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "cp": list(ps.get_context_parallel_global_ranks()),
        "dp": ranks(ps.get_data_parallel_group()),
        "dp_cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
    }
    if layout.hcp:
        for level, group in enumerate(ps.get_hierarchical_context_parallel_groups()):
            found[f"hcp{level}"] = ranks(group)
    return found


def verify_against_layout(ps: Any, layout: Topology) -> None:
    """Compare megatron's groups of this rank with ``layout`` and agree across ranks.

    One all-gather of (layout digest, mismatch flag); every rank raises the same error.
    """
    rank = dist.get_rank()
    expected = {name: layout.group_of(name, rank) for name in ("tp", "cp", "dp", "dp_cp", "pp")}
    for level, group in enumerate(layout.hcp_of(rank)):
        expected[f"hcp{level}"] = group
    found = _megatron_groups(ps, layout)
    diffs = {k: (expected[k], found.get(k)) for k in expected if expected[k] != found.get(k)}
    mine = torch.tensor([_layout_digest(layout), int(bool(diffs))], dtype=torch.int64,
                        device=collective_device())
    mine = mine.to(_collective_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()
    bad_digest = sorted(int(r) for r in torch.nonzero(table[:, 0] != table[0, 0]).flatten())
    bad_groups = sorted(int(r) for r in torch.nonzero(table[:, 1]).flatten())
    if bad_digest or bad_groups:
        detail = f"; this rank {rank}: expected vs megatron {diffs}" if diffs else ""
        raise LayoutMismatchError(
            f"process-group layout check failed: ranks {bad_digest} computed a different layout "
            f"than rank 0, ranks {bad_groups} got megatron groups that differ from it{detail}. "
            "Every rank must pass the same configuration."
        )


def initialize_model_parallel(
    config: CPConfig, *, order: str = "tp-cp-ep-dp-pp",
    agreement_timeout: timedelta | None = None, **megatron_kwargs: Any
) -> Topology:
    """Agree on ``config`` across ranks, validate it, initialize megatron's groups (incl.
    hierarchical CP), verify, log.

    Before anything else all ranks compare ``config``, ``order`` and ``megatron_kwargs``
    (:func:`~.agreement.agree_on_config`, bounded by ``agreement_timeout``): a difference or a
    missing rank is an error on every rank, not a hang. ``megatron_kwargs`` go to
    ``megatron.core.parallel_state.initialize_model_parallel`` (e.g.
    ``virtual_pipeline_model_parallel_size``, ``distributed_timeout_minutes``,
    ``create_gloo_process_groups``). Returns the verified layout.
    """
    agree_on_config(config, tag="mpu", timeout=agreement_timeout, order=order,
                    **megatron_kwargs)
    topology = config.resolve(dist.get_world_size(), order=order)  # every rule first
    from megatron.core import parallel_state as ps

    hcp = topology.hierarchical_sizes
    ps.initialize_model_parallel(
        tensor_model_parallel_size=topology.tp,
        pipeline_model_parallel_size=topology.pp,
        context_parallel_size=topology.cp,
        hierarchical_context_parallel_sizes=list(hcp) if hcp else None,
        order=order,
        **megatron_kwargs,
    )
    return _adopt(ps, topology, megatron_kwargs.get("distributed_timeout_minutes"),
                  agreement_timeout)


def adopt_initialized_mpu(config: CPConfig, *, order: str = "tp-cp-ep-dp-pp",
                          distributed_timeout_minutes: int | None = None,
                          agreement_timeout: timedelta | None = None) -> Topology:
    """megatron's groups, initialized by another caller of megatron's
    ``initialize_model_parallel`` (e.g. Megatron-Bridge's own MPU path) for ``config``: checked
    against the layout on every rank, logged on rank 0 and, for dynamic CP, completed with its
    groups - as :func:`initialize_model_parallel` does after its own call. Collective."""
    from megatron.core import parallel_state as ps

    topology = config.resolve(dist.get_world_size(), order=order)
    return _adopt(ps, topology, distributed_timeout_minutes, agreement_timeout)


def _adopt(ps: Any, topology: Topology, timeout_minutes: int | None,
           agreement_timeout: timedelta | None) -> Topology:
    verify_against_layout(ps, topology)
    release_at_exit()  # megatron's caches must not carry the groups into interpreter teardown
    if topology.dynamic:
        _create_dynamic_groups(ps, topology, {"distributed_timeout_minutes": timeout_minutes},
                               agreement_timeout)
    if dist.get_rank() == 0:
        for line in describe_cp_groups(topology):
            logger.info(line)
    return topology


# dynamic hierarchical CP on the MPU path: (a2a size, this rank's a2a group, p2p ring per size)
# kept in megatron's parallel_state module beside _HYBRID_DP_CP_GROUPS (set here, the thin MPU
# layer, and cleared by destroy_model_parallel)
_DYNAMIC_HCP = "_MEGATRON_HCP_DYNAMIC_HCP_LEVELS"


def _create_dynamic_groups(ps: Any, topology: Topology, megatron_kwargs: dict[str, Any],
                           agreement_timeout: timedelta | None = None) -> None:
    """Dynamic CP groups of ``topology`` into megatron's ``_HYBRID_DP_CP_GROUPS`` (created by
    megatron's ``create_group`` so that ``destroy_model_parallel`` destroys them); under dynamic
    hierarchical CP each group's levels too."""

    minutes = megatron_kwargs.get("distributed_timeout_minutes")
    groups = create_dynamic_cp_groups(
        topology.groups["dp_cp"], ps.get_data_parallel_group(with_context_parallel=True),
        topology.dynamic_min_size, new_group=ps.create_group,
        timeout=timedelta(minutes=minutes) if minutes else None,
        agreement_timeout=agreement_timeout, a2a_size=topology.dynamic_a2a_size,
    )
    a2a_size = topology.dynamic_a2a_size
    setattr(ps, _DYNAMIC_HCP, None if a2a_size is None else (
        a2a_size, groups.a2a_group, dict(groups.p2p_by_size)))
    table = ps._HYBRID_DP_CP_GROUPS
    table.clear()
    # every allowed size but DPxCP (megatron answers that one with its DPxCP group); size 1
    # maps to None, megatron's "local_cp_size 1, no group"
    table.update({size: g for size, g in groups.by_size.items() if size != groups.size})


def dynamic_cp_groups() -> DynamicCPGroups:
    """This rank's dynamic CP groups on the MPU path (after :func:`initialize_model_parallel`
    with ``dynamic_context_parallel``)."""
    from megatron.core import parallel_state as ps

    table = dict(ps._HYBRID_DP_CP_GROUPS or {})
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    ranks = dist.get_process_group_ranks(dp_cp)
    by_size: dict[int, Any] = {**table, len(ranks): dp_cp}
    if not table and len(ranks) > 1:
        raise RuntimeError(
            "no dynamic CP groups: call megatron_hcp.parallel_state.initialize_model_parallel "
            "with a config that sets dynamic_context_parallel=True"
        )
    levels = getattr(ps, _DYNAMIC_HCP, None)
    if levels is None:
        return DynamicCPGroups(ranks, by_size, min(by_size))
    a2a_size, a2a_group, p2p_by_size = levels
    return DynamicCPGroups(ranks, by_size, min(by_size), a2a_size=a2a_size,
                           a2a_group=a2a_group, p2p_by_size=dict(p2p_by_size))


# Module globals of megatron-core 0.16.1's parallel_state that destroy_model_parallel leaves set
# (measured: init + destroy for TP/CP/PP/HCP layouts). The helpers that read them
# (is_rank_in_embedding_group, get_pipeline_model_parallel_last_rank, ...) then answer from a
# destroyed layout, e.g. extra embedding all-reduces on some ranks: a deadlock.
STALE_AFTER_DESTROY = (
    _DYNAMIC_HCP,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_DATA_PARALLEL_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
    "_EMBEDDING_GLOBAL_RANKS",
    "_EXPERT_MODEL_PARALLEL_RANKS",
    "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_PIPELINE_GLOBAL_RANKS",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
)


def forget_stale_groups(ps: Any) -> None:
    """Reset what megatron-core 0.16.1's ``destroy_model_parallel`` leaves behind.

    :data:`STALE_AFTER_DESTROY` plus the hybrid DPxCP group table (a dict).
    """
    for name in STALE_AFTER_DESTROY:
        if hasattr(ps, name):
            setattr(ps, name, None)
    hybrid = getattr(ps, "_HYBRID_DP_CP_GROUPS", None)
    if isinstance(hybrid, dict):
        hybrid.clear()


def destroy_model_parallel() -> None:
    """megatron's ``destroy_model_parallel``, then destroy the groups it created and
    :func:`forget_stale_groups`."""
    from megatron.core import parallel_state as ps

    created = list(getattr(ps, "_global_process_group_list", None) or [])
    ps.destroy_model_parallel()
    destroy_groups(created)
    forget_stale_groups(ps)


def mpu_groups_by_field() -> dict[str, Any]:
    """megatron's initialized MPU groups, keyed by every ``ProcessGroupCollection`` field of the
    installed megatron-core (upstream's own mapping; to compare a decentralized collection with
    the MPU path)."""
    from dataclasses import fields

    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return {f.name: getattr(pgc, f.name, None) for f in fields(pgc)}


@contextmanager
def megatron_memory_buffer() -> Iterator[None]:
    """megatron's global memory buffer for the duration of a block, when nothing set it.

    megatron's TP layers take their sequence-parallel all-gather buffer from
    ``parallel_state.get_global_memory_buffer()``, which only ``initialize_model_parallel``
    creates; a model built on a decentralized process-group collection would assert there.
    Created here (and destroyed afterwards) only when absent, so an MPU run keeps its own.
    """
    from megatron.core import parallel_state as ps

    created = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None
    if created:
        ps._set_global_memory_buffer()
    try:
        yield
    finally:
        if created:
            ps.destroy_global_memory_buffer()
