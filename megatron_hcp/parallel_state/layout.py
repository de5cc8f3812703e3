"""Rank lists of every parallel group, as pure functions (no torch.distributed).

Ranks are laid out on a grid whose axes follow megatron's ``order`` string
(``tp-cp-ep-dp-pp`` or ``tp-cp-ep-pp-dp``), the first axis varying fastest. A group of axes
``"tp-cp"`` holds the ranks that differ only along those axes; groups are listed with the
remaining axes varying first-fastest, members with the chosen axes first-fastest in grid order
(megatron's convention, so group lists compare equal to megatron-core's element for element).

Hierarchical CP splits each CP group (``n`` ranks) into levels of sizes ``[s0, s1, ...]``:
level ``i`` groups ranks whose CP index differs only in digit ``i`` of the mixed-radix number
``cp_index = d0 + s0*d1 + s0*s1*d2 ...``. Level 0 (a2a) is therefore contiguous inside the CP
group and level 1 (p2p) strided, as megatron-core and Transformer Engine expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import dynamic_levels, is_power_of_two

__all__ = [
    "ORDERS",
    "ParallelLayout",
    "dynamic_cp_blocks",
    "group_containing",
    "hierarchical_level_groups",
    "orthogonal_groups",
]

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
Groups = list[list[int]]


def _full_order(order: str, sizes: dict[str, int]) -> list[str]:
    axes = order.lower().split("-")
    unknown = [a for a in axes if a not in sizes]
    if unknown:
        raise ValueError(f"order={order!r} names unknown axes {unknown}; use {sorted(sizes)}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"order={order!r} repeats an axis")
    missing = [a for a in sizes if a not in axes]
    for axis in missing:
        if sizes[axis] != 1:
            raise ValueError(
                f"order={order!r} omits axis {axis!r} of size {sizes[axis]}; name every axis > 1"
            )
    return axes + missing


def orthogonal_groups(
    sizes: dict[str, int], order: str, axes: str, rank_offset: int = 0
) -> Groups:
    """Rank lists of the groups spanning ``axes`` (e.g. ``"tp-cp"``) on the ``sizes`` grid."""
    full = _full_order(order, sizes)
    requested = axes.lower().split("-")
    for axis in requested:
        if axis not in full:
            raise ValueError(f"axes={axes!r}: unknown axis {axis!r}")
    chosen = [a for a in full if a in requested]  # members vary in grid order, not request order
    world = math.prod(sizes[a] for a in full)
    # numpy is C-ordered (last axis fastest); the grid's first axis must be fastest.
    grid = np.arange(world).reshape([sizes[a] for a in reversed(full)])
    numpy_axis = {a: len(full) - 1 - i for i, a in enumerate(full)}
    others = [a for a in full if a not in chosen]
    perm = [numpy_axis[a] for a in reversed(others)] + [numpy_axis[a] for a in reversed(chosen)]
    group_size = math.prod(sizes[a] for a in chosen)
    groups = grid.transpose(perm).reshape(world // group_size, group_size) + rank_offset
    return groups.tolist()


def hierarchical_level_groups(ranks: Sequence[int], level_sizes: Sequence[int]) -> list[Groups]:
    """Split one CP group into the groups of each hierarchical level (innermost first)."""
    if math.prod(level_sizes) != len(ranks):
        raise ValueError(
            f"hierarchical sizes {list(level_sizes)} multiply to {math.prod(level_sizes)}, "
            f"but the CP group has {len(ranks)} ranks"
        )
    return _level_groups(np.asarray(ranks).reshape(1, -1), level_sizes)


def _level_groups(cp_groups: np.ndarray, level_sizes: Sequence[int]) -> list[Groups]:
    """The levels of every row of ``cp_groups`` (one CP group a row), group after group."""
    levels = []
    n, cp = cp_groups.shape
    for level, size in enumerate(level_sizes):
        inner = math.prod(level_sizes[:level])
        outer = cp // (inner * size)
        # cp_index = i + inner * (d + size * o): groups vary d for fixed (o, i).
        levels.append(cp_groups.reshape(n, outer, size, inner).transpose(0, 1, 3, 2)
                      .reshape(-1, size).tolist())
    return levels


def group_containing(groups: Groups, rank: int) -> list[int] | None:
    """The group that contains ``rank``, or None."""
    for group in groups:
        if rank in group:
            return group
    return None


def _embedding_ranks(pp_ranks: list[int]) -> list[int]:
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of a (TP, CP, EP, DP, PP) layout, with the HCP levels of each CP group.

    ``hcp[level]`` lists the groups of that level across all CP groups (level 0 = a2a).
    Expert groups follow megatron's expert rank generator (``tp`` replaced by the expert TP size,
    ``cp`` folded into expert DP).
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    order: str = "tp-cp-ep-dp-pp"
    hierarchical_sizes: tuple[int, ...] | None = None
    rank_offset: int = 0
    groups: dict[str, Groups] = field(init=False, repr=False, compare=False)
    hcp: list[Groups] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        model = self.tp * self.cp * self.pp
        for name in ("world_size", "tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.world_size % model:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp*cp*pp={model}; "
                "use a world size that is a multiple of it"
            )
        if self.order.lower() not in ORDERS:
            raise ValueError(f"order={self.order!r}: use one of {ORDERS}")
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        groups: dict[str, Groups] = {}
        for axes in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp", "tp-dp"):
            groups[axes.replace("-", "_")] = orthogonal_groups(
                dense, self.order, axes, self.rank_offset
            )
        groups["embd"] = [_embedding_ranks(g) for g in groups["pp"]]
        groups["pos_embd"] = [[g[0]] for g in groups["pp"]]
        etp = self.etp or self.tp
        expert_model = etp * self.ep * self.pp
        if self.world_size % expert_model:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by etp*ep*pp={expert_model}"
            )
        expert = {
            "tp": etp,
            "cp": 1,
            "ep": self.ep,
            "dp": self.world_size // expert_model,
            "pp": self.pp,
        }
        for name, axes in (
            ("ep", "ep"),
            ("expt_tp", "tp"),
            ("tp_ep", "tp-ep"),
            ("tp_ep_pp", "tp-ep-pp"),
            ("expt_dp", "dp"),
        ):
            groups[name] = orthogonal_groups(expert, self.order, axes, self.rank_offset)
        object.__setattr__(self, "groups", groups)
        hcp: list[Groups] = []
        if self.hierarchical_sizes:
            hierarchical_level_groups(groups["cp"][0], self.hierarchical_sizes)  # checks sizes
            hcp = _level_groups(np.asarray(groups["cp"]), self.hierarchical_sizes)
        object.__setattr__(self, "hcp", hcp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def group_of(self, name: str, rank: int) -> list[int] | None:
        """Members of the ``name`` group (e.g. ``"cp"``, ``"tp_cp"``) that holds ``rank``."""
        return group_containing(self.groups[name], rank)

    def hcp_of(self, rank: int) -> list[list[int]]:
        """This rank's group at every hierarchical level (innermost first)."""
        return [group_containing(level, rank) or [] for level in self.hcp]

    def to_json(self) -> dict:
        """Plain dict for ``megatron-hcp layout --json``: ``cp``, ``hcp`` and every other group."""
        out: dict = {
            "world_size": self.world_size,
            "sizes": {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "ep": self.ep},
            "order": self.order,
            "hierarchical_context_parallel_sizes": (
                list(self.hierarchical_sizes) if self.hierarchical_sizes else None
            ),
            "cp": self.groups["cp"],
            "hcp": self.hcp,
        }
        out["groups"] = {k: v for k, v in self.groups.items() if k != "cp"}
        return out


def dynamic_cp_blocks(dp_cp_ranks: Sequence[int], min_size: int = 1) -> dict[int, Groups]:
    """Dynamic-CP groups of one DPxCP group: for every power of two from ``min_size`` up to its
    size, contiguous aligned blocks of its ranks (size == len(dp_cp_ranks) is the whole group).
    """
    n = len(dp_cp_ranks)
    if not is_power_of_two(n):
        raise ValueError(f"a DPxCP group of {n} ranks: dynamic CP needs a power of two")
    if not is_power_of_two(min_size) or min_size > n:
        raise ValueError(
            f"min_dynamic_context_parallel_size={min_size} must be a power of two <= {n}"
        )
    blocks: dict[int, Groups] = {}
    size = min_size
    while size <= n:
        blocks[size] = [list(dp_cp_ranks[i : i + size]) for i in range(0, n, size)]
        size *= 2
    return blocks


def dynamic_hcp_levels(block: Sequence[int], a2a_size: int) -> tuple[Groups, Groups] | None:
    """The (a2a, p2p) level groups of one dynamic CP group ``block`` under dynamic hierarchical
    CP with a2a level ``a2a_size``: a2a = contiguous runs of ``a2a_size`` ranks, p2p = the
    strided rings across them (as :func:`hierarchical_level_groups`). None when the block has at
    most ``a2a_size`` ranks (the group is pure a2a)."""
    c = len(block)
    if not is_power_of_two(a2a_size) or not is_power_of_two(c):
        raise ValueError(f"a dynamic group of {c} ranks with an a2a level of {a2a_size}: both "
                         "must be powers of two")
    a2a, p2p = dynamic_levels(c, a2a_size)  # the one rule of the level sizes
    if p2p == 1:
        return None
    return hierarchical_level_groups(list(block), [a2a, p2p])
