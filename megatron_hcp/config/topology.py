"""One parallel topology: every fact derived from a validated CP setup and a world size.

:class:`Topology` is what :meth:`~.rules.CPConfig.resolve` returns: sizes and DP, the HCP levels,
the dynamic-CP blocks and their levels (one convention, :func:`dynamic_levels`), the rank list of
every group, and the grids megatron's ``HyperCommGrid`` enumerates. The MPU path, the
decentralized collection, the planner, the trainer and Megatron-Bridge's client all read it;
none re-derives a size from the configuration's fields. Pure: numpy, no torch.distributed.

Ranks lie on a grid whose axes follow megatron's ``order`` string (``tp-cp-ep-dp-pp`` or
``tp-cp-ep-pp-dp``), the first axis varying fastest. A group of axes ``"tp-cp"`` holds the
ranks that differ only along those axes; groups are listed with the remaining axes varying
first-fastest, members with the chosen axes first-fastest in grid order (megatron's convention,
so group lists compare equal to megatron-core's element for element).

Hierarchical CP splits each CP group (``n`` ranks) into levels of sizes ``[s0, s1, ...]``:
level ``i`` groups ranks whose CP index differs only in digit ``i`` of the mixed-radix number
``cp_index = d0 + s0*d1 + s0*s1*d2 ...``. Level 0 (a2a) is therefore contiguous inside the CP
group and level 1 (p2p) strided, as megatron-core and Transformer Engine expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

__all__ = [
    "ORDERS",
    "Groups",
    "Topology",
    "describe_levels",
    "dynamic_cp_blocks",
    "dynamic_hcp_levels",
    "dynamic_levels",
    "group_containing",
    "hierarchical_level_groups",
    "is_power_of_two",
    "orthogonal_groups",
]

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
Groups = list[list[int]]


def is_power_of_two(n: int) -> bool:
    """The one power-of-two rule (dynamic CP sizes, DPxCP, aligned blocks)."""
    return n >= 1 and (n & (n - 1)) == 0


def dynamic_levels(group_size: int, a2a_size: int | None) -> tuple[int, int]:
    """The one rule for the (a2a, p2p) level sizes of a dynamic CP group of ``group_size``
    ranks: under dynamic hierarchical CP (``a2a_size`` = ``hierarchical_context_parallel_sizes
    [0]``) a2a = ``min(c, a)`` contiguous ranks and p2p = ``c / a2a`` (``p2p == 1``: pure a2a);
    without it (None, or 1) a flat ring: ``(1, c)``."""
    if not a2a_size or a2a_size <= 1:
        return 1, group_size
    a2a = min(group_size, a2a_size)
    return a2a, group_size // a2a


def describe_levels(group_size: int, a2a_size: int | None) -> str:
    """What a dynamic CP group of ``group_size`` ranks runs, in words (:func:`dynamic_levels`):
    ``no CP``, ``p2p 4``, ``pure a2a over 4`` or ``a2a 2 x p2p 4``."""
    if group_size == 1:
        return "no CP"
    a2a, p2p = dynamic_levels(group_size, a2a_size)
    if a2a == 1:
        return f"p2p {p2p}"
    return f"pure a2a over {a2a}" if p2p == 1 else f"a2a {a2a} x p2p {p2p}"


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


def _embedding_ranks(pp_ranks: list[int]) -> list[int]:
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


# the dense groups every path builds (name -> grid axes)
_DENSE_AXES = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp", "tp-dp")
# expert groups on megatron's expert rank generator: name -> axes
_EXPERT_AXES = (("ep", "ep"), ("expt_tp", "tp"), ("tp_ep", "tp-ep"), ("tp_ep_pp", "tp-ep-pp"),
                ("expt_dp", "dp"))


@dataclass(frozen=True)
class Topology:
    """Every derived fact of one (TP, CP, EP, DP, PP) setup, with HCP levels and dynamic CP.

    Built by :meth:`~.rules.CPConfig.resolve` from a validated configuration (``config`` is it);
    built from sizes alone it describes rank lists only (``config`` None). ``groups[name]`` lists
    every group of ``name`` (``"tp"``, ``"cp"``, ``"dp_cp"``, ``"tp_cp"``, ``"embd"``, expert
    groups, ...); ``hcp[level]`` the groups of that hierarchical level across all CP groups
    (level 0 = a2a). Expert groups follow megatron's expert rank generator (``tp`` replaced by
    the expert TP size, ``cp`` folded into expert DP). ``dynamic_min_size`` (None: dynamic CP
    off) and ``dynamic_a2a_size`` (dynamic hierarchical CP's a2a level) give the dynamic groups.
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
    dynamic_min_size: int | None = None
    dynamic_a2a_size: int | None = None
    config: Any = field(default=None, compare=False, repr=False)  # the CPConfig resolved
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
        if self.hierarchical_sizes is not None:
            object.__setattr__(self, "hierarchical_sizes", tuple(self.hierarchical_sizes))
        if self.etp is None:  # megatron's default: expert TP = TP
            object.__setattr__(self, "etp", self.tp)
        groups: dict[str, Groups] = {}
        for axes in _DENSE_AXES:
            groups[axes.replace("-", "_")] = orthogonal_groups(
                self.dense_sizes, self.order, axes, self.rank_offset)
        groups["embd"] = [_embedding_ranks(g) for g in groups["pp"]]
        groups["pos_embd"] = [[g[0]] for g in groups["pp"]]
        expert_model = self.expert_tp * self.ep * self.pp
        if self.world_size % expert_model:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by etp*ep*pp={expert_model}"
            )
        for name, axes in _EXPERT_AXES:
            groups[name] = orthogonal_groups(self.expert_sizes, self.order, axes,
                                             self.rank_offset)
        object.__setattr__(self, "groups", groups)
        hcp: list[Groups] = []
        if self.hierarchical_sizes:
            hierarchical_level_groups(groups["cp"][0], self.hierarchical_sizes)  # checks sizes
            hcp = _level_groups(np.asarray(groups["cp"]), self.hierarchical_sizes)
        object.__setattr__(self, "hcp", hcp)
        if self.dynamic_min_size is not None:
            self.dynamic_blocks  # noqa: B018 - checks DPxCP and the minimum size now

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def dp_cp(self) -> int:
        """Ranks of one DPxCP group (the ranks dynamic CP carves its groups from)."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp  # set in __post_init__; `or` for the type checker

    @property
    def a2a_size(self) -> int:
        """The a2a (inner) level of hierarchical CP; 1 without it."""
        return self.hierarchical_sizes[0] if self.hierarchical_sizes else 1

    @property
    def p2p_size(self) -> int:
        """The p2p (outer) level of hierarchical CP; 1 without it."""
        sizes = self.hierarchical_sizes
        return sizes[1] if sizes and len(sizes) > 1 else 1

    @property
    def dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        return {"tp": self.expert_tp, "cp": 1, "ep": self.ep,
                "dp": self.world_size // (self.expert_tp * self.ep * self.pp), "pp": self.pp}

    # ------------------------------------------------------------------ megatron's grids
    @property
    def dense_grid(self) -> tuple[list[int], list[str]]:
        """(shape, dim names) of megatron's dense ``HyperCommGrid``."""
        return [self.tp, self.cp, self.dp, self.pp], ["tp", "cp", "dp", "pp"]

    @property
    def expert_grid(self) -> tuple[list[int], list[str]]:
        """(shape, dim names) of megatron's expert ``HyperCommGrid``."""
        sizes = self.expert_sizes
        return [sizes["tp"], self.ep, sizes["dp"], self.pp], ["tp", "ep", "dp", "pp"]

    @property
    def hcp_grid(self) -> tuple[list[int], list[str]] | None:
        """(shape, dim names) of the dense grid with ``cp`` split into its levels (innermost
        first), or None without hierarchical CP."""
        if not self.hierarchical_sizes:
            return None
        return ([self.tp, *self.hierarchical_sizes, self.dp, self.pp],
                ["tp", "a2a", "p2p", "dp", "pp"])

    # ------------------------------------------------------------------ groups
    def group_of(self, name: str, rank: int) -> list[int] | None:
        """Members of the ``name`` group (e.g. ``"cp"``, ``"tp_cp"``) that holds ``rank``."""
        return group_containing(self.groups[name], rank)

    def hcp_of(self, rank: int) -> list[list[int]]:
        """This rank's group at every hierarchical level (innermost first)."""
        return [group_containing(level, rank) or [] for level in self.hcp]

    # ------------------------------------------------------------------ dynamic CP
    @property
    def dynamic(self) -> bool:
        return self.dynamic_min_size is not None

    @cached_property
    def dynamic_blocks(self) -> dict[int, Groups]:
        """Every dynamic CP group, by size: the aligned blocks of every DPxCP group, group after
        group (empty without dynamic CP)."""
        if self.dynamic_min_size is None:
            return {}
        out: dict[int, Groups] = {}
        for ranks in self.groups["dp_cp"]:
            for size, blocks in dynamic_cp_blocks(ranks, self.dynamic_min_size).items():
                out.setdefault(size, []).extend(blocks)
        return out

    @property
    def dynamic_sizes(self) -> list[int]:
        """The dynamic CP sizes, smallest first (empty without dynamic CP)."""
        return sorted(self.dynamic_blocks)

    def dynamic_levels(self, size: int) -> tuple[int, int]:
        """(a2a, p2p) of a dynamic group of ``size`` ranks (:func:`dynamic_levels`)."""
        return dynamic_levels(size, self.dynamic_a2a_size)

    def describe_levels(self, size: int) -> str:
        """What a dynamic group of ``size`` ranks runs, in words (:func:`describe_levels`)."""
        return describe_levels(size, self.dynamic_a2a_size)

    def dynamic_level_groups(self, block: Sequence[int]) -> tuple[Groups, Groups] | None:
        """The (a2a, p2p) groups of one dynamic block (None: pure a2a, or no dynamic HCP)."""
        if not self.dynamic_a2a_size:
            return None
        return dynamic_hcp_levels(block, self.dynamic_a2a_size)

    # ------------------------------------------------------------------ output
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
