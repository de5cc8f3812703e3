"""Layouts equal megatron-core's own groups (RankGenerator and create_hierarchical_groups)."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state as ps

from megatron_hcp.cli import main as cli_main
from megatron_hcp.parallel_state.layout import (
    ParallelLayout,
    hierarchical_level_groups,
    orthogonal_groups,
)

AXES = ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp", "tp-dp"]
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]


def megatron_hierarchical(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """Run megatron's create_hierarchical_groups, recording the rank lists it creates."""
    created: list[tuple[str, list[int]]] = []

    def record(ranks, group_desc=None, **kwargs):
        created.append((group_desc, list(ranks)))
        return object()

    original = ps.create_group
    ps.create_group = record
    try:
        ps.create_hierarchical_groups(0, ranks, sizes, group_desc="CP")
    finally:
        ps.create_group = original
    return [[r for d, r in created if d.endswith(f"_L{lvl}")] for lvl in range(len(sizes))]


@pytest.mark.parametrize("order", ORDERS)
def test_dense_groups_equal_rank_generator(order):
    count = 0
    for tp, cp, pp, dp, offset in itertools.product(
        [1, 2, 4], [1, 2, 4, 8], [1, 2, 3], [1, 2, 3], [0, 8]
    ):
        gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=offset)
        sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        for axes in AXES:
            assert orthogonal_groups(sizes, order, axes, offset) == gen.get_ranks(axes), (
                tp, cp, pp, dp, axes
            )
            count += 1
    assert count > 1000


@settings(max_examples=300, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    ep=st.sampled_from([1, 2, 4]),
    pp=st.integers(1, 4),
    edp=st.integers(1, 4),
    order=st.sampled_from(ORDERS),
)
def test_expert_groups_equal_rank_generator(tp, ep, pp, edp, order):
    world = tp * ep * pp * edp
    layout = ParallelLayout(world_size=world, tp=1, cp=1, pp=pp, ep=ep, etp=tp, order=order)
    gen = ps.RankGenerator(tp=tp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    for name, axes in [("ep", "ep"), ("expt_tp", "tp"), ("tp_ep", "tp-ep"),
                       ("tp_ep_pp", "tp-ep-pp"), ("expt_dp", "dp")]:
        assert layout.groups[name] == gen.get_ranks(axes)


def level_sizes():
    return st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(sizes=level_sizes(), start=st.integers(0, 64), stride=st.integers(1, 4))
def test_hierarchical_levels_equal_megatron(sizes, start, stride):
    n = math.prod(sizes)
    ranks = [start + stride * i for i in range(n)]
    assert hierarchical_level_groups(ranks, sizes) == megatron_hierarchical(ranks, sizes)


def test_hierarchical_level0_contiguous_level1_strided():
    levels = hierarchical_level_groups(list(range(8)), [2, 4])
    assert levels[0] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert levels[1] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@settings(max_examples=200, deadline=None)
@given(
    tp=st.sampled_from([1, 2]),
    a2a=st.sampled_from([1, 2, 4]),
    p2p=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2, 3]),
    order=st.sampled_from(ORDERS),
)
def test_full_layout_hcp_equals_megatron(tp, a2a, p2p, pp, dp, order):
    cp = a2a * p2p
    world = tp * cp * pp * dp
    layout = ParallelLayout(
        world_size=world, tp=tp, cp=cp, pp=pp, order=order, hierarchical_sizes=(a2a, p2p)
    )
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    assert layout.groups["cp"] == gen.get_ranks("cp")
    expected = [[], []]
    for cp_ranks in gen.get_ranks("cp"):
        for level, groups in enumerate(megatron_hierarchical(cp_ranks, [a2a, p2p])):
            expected[level].extend(groups)
    assert layout.hcp == expected
    for rank in range(world):
        a2a_group, p2p_group = layout.hcp_of(rank)
        cp_group = layout.group_of("cp", rank)
        assert rank in a2a_group and rank in p2p_group
        assert set(a2a_group) | set(p2p_group) <= set(cp_group)
        # flat CP position = p2p index * a2a size + a2a index
        assert cp_group.index(rank) == p2p_group.index(rank) * a2a + a2a_group.index(rank)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=6, tp=4), "not divisible by tp*cp*pp"),
        (dict(world_size=8, cp=4, hierarchical_sizes=(3, 2)), "multiply to 6"),
        (dict(world_size=8, order="pp-dp-tp"), "use one of"),
        (dict(world_size=0), "must be >= 1"),
    ],
)
def test_layout_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ParallelLayout(**kwargs)


def test_cli_layout_json(capsys):
    code = cli_main(["layout", "--world-size", "8", "--tp", "2", "--cp", "4", "--hcp", "2,2",
                     "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert data["hcp"] == [[[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]]]


def test_cli_layout_text_and_error(capsys):
    assert cli_main(["layout", "--world-size", "4", "--cp", "4", "--hcp", "2,2"]) == 0
    out = capsys.readouterr().out
    assert "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS created: cp=4 a2a(level 0)=2 [[0,1],[2,3]] " \
        "p2p(level 1)=2 [[0,2],[1,3]]" in out
    assert cli_main(["layout", "--world-size", "4", "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "CONTEXT_PARALLEL_GROUP created: cp=4 [[0,1,2,3]]" in out
    assert "HIERARCHICAL" not in out
    assert cli_main(["layout", "--world-size", "6", "--cp", "4"]) == 2
