"""A complete ProcessGroupCollection on the decentralized path, with hierarchical CP filled in.

Built like Megatron-Bridge's ``_create_pg_collection``: megatron-core ``HyperCommGrid`` over
``[tp, cp, dp, pp]`` for the dense groups and ``[etp, ep, edp, pp]`` for the expert groups, the
embedding groups from the PP enumeration. ``hcp`` comes from a factorization that splits ``cp``
into its levels, ``[tp, a2a, p2p, dp, pp]``, innermost first: a registered view of the one dense
grid where megatron-core has grid views (0.19: ``HyperCommGrid.register_view``, so the grid can be
saved with ``save_grid``), else a second grid over the same ranks (0.16). Every field the
installed megatron-core's ``ProcessGroupCollection`` declares is set like the MPU path sets it
(0.19's ``gtp_remat`` groups are one rank each, ``*_gtp_remat`` equal their plain groups,
``*_ag`` are None).

Before any group is created, every grid enumeration is checked against
:class:`~megatron_hcp.config.Topology` (``CPConfig.resolve``: the single source of the rank
arithmetic, equal to the MPU path; every grid's shape is the topology's): a mismatch is an
error on every rank, not a silent difference between the two initialization paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..config import CPConfig, Topology
from ..group_release import release_at_exit
from .agreement import agree_on_config
from .dynamic import create_dynamic_cp_groups, dynamic_cp_groups_of
from .groups import destroy_groups, group_kwargs
from .report import describe_cp_groups

__all__ = ["LayoutDisagreementError", "create_pg_collection", "create_pg_collection_and_grid",
           "destroy_pg_collection", "grid_views_available"]

logger = logging.getLogger("megatron_hcp")

# collection field -> (grid, dims); single-dimension groups keep rank order (CP positions)
_DENSE = {
    "tp": ["tp"], "cp": ["cp"], "pp": ["pp"], "dp": ["dp"], "mp": ["tp", "pp"],
    "tp_cp": ["tp", "cp"], "tp_dp_cp": ["tp", "dp", "cp"], "dp_cp": ["dp", "cp"],
}
_EXPERT = {"ep": ["ep"], "expt_tp": ["tp"], "tp_ep": ["tp", "ep"], "tp_ep_pp": ["tp", "ep", "pp"],
           "expt_dp": ["dp"]}
_LAYOUT_NAME = {"mp": "tp_pp"}


class LayoutDisagreementError(RuntimeError):
    """HyperCommGrid would build a group whose members differ from the MPU layout."""


def _same(grid_groups: list[list[int]], layout_groups: list[list[int]], ordered: bool) -> bool:
    if ordered:
        return sorted(map(list, grid_groups)) == sorted(map(list, layout_groups))
    return sorted(sorted(g) for g in grid_groups) == sorted(sorted(g) for g in layout_groups)


def _check(name: str, grid_groups, layout_groups, ordered: bool) -> None:
    if not _same(grid_groups, layout_groups, ordered):
        raise LayoutDisagreementError(
            f"HyperCommGrid group {name!r} {grid_groups} differs from the MPU layout "
            f"{layout_groups}; refusing to build groups that disagree between the paths"
        )


def _embedding_groups(pp_groups, get_embedding_ranks, get_position_embedding_ranks, pp_size):
    embd, pos = [], []
    for ranks in pp_groups:
        embd.append(get_embedding_ranks(ranks, pp_size) if get_embedding_ranks else (
            [ranks[0]] if len(ranks) == 1 else [ranks[0], ranks[-1]]))
        pos.append(get_position_embedding_ranks(ranks, pp_size) if get_position_embedding_ranks
                   else [ranks[0]])
    return embd, pos


def create_pg_collection(config: CPConfig, **kwargs: Any):
    """Every group of the decentralized path for ``config``; see
    :func:`create_pg_collection_and_grid` for the arguments."""
    return create_pg_collection_and_grid(config, **kwargs)[0]


def grid_views_available() -> bool:
    """megatron-core's HyperCommGrid can register views (0.19+): one grid describes HCP."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    return hasattr(HyperCommGrid, "register_view")


def _hcp_levels(HyperCommGrid, grid, topology: Topology, grid_kwargs: dict):
    """(rank enumeration of a level dim, group factory of a level dim, grid holding the view).

    A view of ``grid`` where grid views exist (megatron-core 0.19+), else a second grid.
    """
    shape, names = topology.hcp_grid
    if grid_views_available():
        grid.register_view("hcp", shape, names, shared_dims=["tp", "dp", "pp"])
        return (lambda dim: grid.get_rank_enum([dim], view="hcp"),
                lambda dim, **kw: grid.create_pg([dim], view="hcp", **kw), True)
    levels = HyperCommGrid(shape, names, **grid_kwargs)
    return (lambda dim: levels.get_rank_enum([dim]),
            lambda dim, **kw: levels.create_pg([dim], **kw), False)


def create_pg_collection_and_grid(
    config: CPConfig,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    world_size: int | None = None,
    rank_offset: int = 0,
    backend: str | None = None,
    timeout: timedelta | None = None,
    pg_options: Any = None,
    hcp_pg_options: Any = None,
    get_embedding_ranks: Callable | None = None,
    get_position_embedding_ranks: Callable | None = None,
    agreement_timeout: timedelta | None = None,
):
    """(collection, grid): every group of the decentralized path for ``config`` (``hcp`` set for
    a2a+p2p) and the dense ``HyperCommGrid`` when it alone describes the collection (None when
    ``hcp`` needed a second grid: megatron-core without grid views).

    ``world_size`` ranks starting at ``rank_offset`` form the grid (default: the whole world
    from 0), so several grids can share one world. ``timeout``/``pg_options`` go to every group,
    ``hcp_pg_options`` (one value or one per level) to the hierarchical ones. All ranks of the
    world must call this with the same arguments (group creation is collective): they are
    compared first (:func:`~megatron_hcp.parallel_state.agreement.agree_on_config`, bounded by
    ``agreement_timeout``), so a difference or a missing rank is an error on every rank.
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .pg_collection import HCPProcessGroupCollection

    agree_on_config(config, tag="pg_collection", timeout=agreement_timeout,
                    expert_model_parallel_size=expert_model_parallel_size,
                    expert_tensor_parallel_size=expert_tensor_parallel_size,
                    grid_world_size=world_size, rank_offset=rank_offset, backend=backend,
                    group_timeout=timeout, pg_options=pg_options, hcp_pg_options=hcp_pg_options)
    release_at_exit()  # megatron's caches must not carry the groups into interpreter teardown
    world = world_size if world_size is not None else dist.get_world_size() - rank_offset
    topology = config.resolve(world, expert_model_parallel_size=expert_model_parallel_size,
                              expert_tensor_parallel_size=expert_tensor_parallel_size,
                              rank_offset=rank_offset)
    grid_kwargs = dict(rank_offset=rank_offset, backend=backend)
    grid = HyperCommGrid(*topology.dense_grid, **grid_kwargs)
    expert = HyperCommGrid(*topology.expert_grid, **grid_kwargs)
    level_enum = make_level = None
    single_grid = True
    if topology.hierarchical_sizes:
        level_enum, make_level, single_grid = _hcp_levels(HyperCommGrid, grid, topology,
                                                          grid_kwargs)

    # ---- pure checks (no collective yet): grid enumerations equal the MPU layout
    for name, dims in _DENSE.items():
        _check(name, grid.get_rank_enum(dims), topology.groups[_LAYOUT_NAME.get(name, name)],
               ordered=len(dims) == 1)
    for name, dims in _EXPERT.items():
        _check(name, expert.get_rank_enum(dims), topology.groups[name], ordered=len(dims) == 1)
    if level_enum is not None:
        for level, dim in enumerate(("a2a", "p2p")):
            _check(f"hcp[{level}]", level_enum(dim), topology.hcp[level], ordered=True)

    kwargs = group_kwargs(timeout, pg_options)
    groups: dict[str, Any] = {}
    for name, dims in _DENSE.items():
        groups[name] = grid.create_pg(dims, group_desc=f"HCP_DECENTRALIZED_{name.upper()}",
                                      **kwargs)
    for name, dims in _EXPERT.items():
        groups[name] = expert.create_pg(dims, group_desc=f"HCP_DECENTRALIZED_{name.upper()}",
                                        **kwargs)
    embd, pos = _embedding_groups(grid.get_rank_enum(["pp"]), get_embedding_ranks,
                                  get_position_embedding_ranks, topology.pp)
    for name, rank_lists in (("embd", embd), ("pos_embd", pos)):
        groups[name], _ = dist.new_subgroups_by_enumeration(rank_lists, backend=backend,
                                                            **kwargs)
    hcp = None
    if make_level is not None:
        options = (list(hcp_pg_options) if isinstance(hcp_pg_options, (list, tuple))
                   else [hcp_pg_options] * 2)
        hcp = []
        for level, dim in enumerate(("a2a", "p2p")):
            level_kwargs = dict(kwargs)
            if options[level] is not None:
                level_kwargs["pg_options"] = options[level]
            hcp.append(make_level(dim, group_desc=f"HIERARCHICAL_CONTEXT_PARALLEL_L{level}",
                                  **level_kwargs))
    # one distributed-optimizer instance spans the grid (as the MPU path builds it)
    groups["intra_dist_opt"] = dist.new_group(list(range(rank_offset, rank_offset + world)),
                                              backend=backend, **kwargs)
    declared = {f.name for f in fields(ProcessGroupCollection)}
    if "gtp_remat" in declared:  # megatron-core 0.19+: weight-rematerialization axes of size 1
        groups["gtp_remat"], _ = dist.new_subgroups_by_enumeration(
            [[r] for r in range(rank_offset, rank_offset + world)], backend=backend, **kwargs)
        groups.update(expt_gtp_remat=groups["gtp_remat"], dp_cp_gtp_remat=groups["dp_cp"],
                      expt_dp_gtp_remat=groups["expt_dp"],
                      tp_ep_pp_with_egtp_remat=groups["tp_ep_pp"], dp_cp_ag=None, expt_dp_ag=None)
    collection = HCPProcessGroupCollection(
        **{k: v for k, v in groups.items() if k in declared},
        hcp=hcp,
        intra_dp_cp=groups["dp_cp"],
        intra_expt_dp=groups["expt_dp"],
        inter_dist_opt=None,
    )
    collection.topology = topology
    if topology.dynamic:  # typed attribute of the collection, destroyed by destroy_pg_collection
        collection.dynamic_cp = create_dynamic_cp_groups(
            topology.groups["dp_cp"], groups["dp_cp"], topology.dynamic_min_size,
            timeout=timeout, pg_options=pg_options, agreement_timeout=agreement_timeout,
            a2a_size=topology.dynamic_a2a_size)
    if dist.get_rank() == rank_offset:
        for line in describe_cp_groups(topology):
            logger.info(line)
    return collection, (grid if single_grid else None)


def destroy_pg_collection(collection: Any) -> None:
    """Destroy every process group of a collection built by :func:`create_pg_collection`."""
    groups = []
    for f in fields(collection):
        value = getattr(collection, f.name, None)
        groups.extend(value if isinstance(value, (list, tuple)) else [value])
    dynamic = dynamic_cp_groups_of(collection)
    if dynamic is not None:
        dynamic.destroy()
        collection.dynamic_cp = None
    destroy_groups(groups)
