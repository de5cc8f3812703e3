"""CPConfig.resolve -> Topology: every derived fact of a setup, validated once (issue #33)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_hcp.config import CPConfig, CPConfigError, Topology, dynamic_levels
from megatron_hcp.config.topology import dynamic_cp_blocks, hierarchical_level_groups
from megatron_hcp.parallel_state.layout import ParallelLayout


def _hcp(**kw) -> CPConfig:
    base = dict(context_parallel_size=4, cp_comm_type="a2a+p2p",
                hierarchical_context_parallel_sizes=[2, 2], tensor_model_parallel_size=2,
                data_parallel_size=2, num_attention_heads=8)
    return CPConfig(**{**base, **kw})


def test_resolve_derives_every_size_and_group_once():
    config = _hcp()
    topo = config.resolve()
    assert topo.config is config and topo.world_size == config.world_size == 16
    assert (topo.tp, topo.cp, topo.pp, topo.dp, topo.dp_cp) == (2, 4, 1, 2, 8)
    assert (topo.a2a_size, topo.p2p_size) == (2, 2)
    # the HCP levels of every CP group: a2a contiguous inside the CP group, p2p strided
    for cp_group in topo.groups["cp"]:
        a2a, p2p = hierarchical_level_groups(cp_group, [2, 2])
        assert all(g in topo.hcp[0] for g in a2a) and all(g in topo.hcp[1] for g in p2p)
    assert len(topo.hcp[0]) == len(topo.hcp[1]) == 16 // 2
    # megatron's grids enumerate exactly the world
    for shape, names in (topo.dense_grid, topo.expert_grid, topo.hcp_grid):
        assert math.prod(shape) == 16 and len(shape) == len(names)
    assert topo.hcp_grid[1] == ["tp", "a2a", "p2p", "dp", "pp"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.cp = 2  # type: ignore[misc]


def test_the_old_layout_name_is_the_topology():
    assert ParallelLayout is Topology
    by_sizes = ParallelLayout(16, tp=2, cp=4, hierarchical_sizes=(2, 2))
    resolved = _hcp().resolve()
    assert by_sizes == resolved and by_sizes.groups == resolved.groups
    assert by_sizes.hcp == resolved.hcp and by_sizes.config is None
    # hierarchical sizes count only with a2a+p2p: another comm type resolves without levels
    plain = _hcp(cp_comm_type="a2a", hierarchical_context_parallel_sizes=None).resolve()
    assert plain.hcp == [] and plain.hcp_grid is None


def test_resolve_refuses_before_anything_is_built():
    with pytest.raises(CPConfigError, match=r"data_parallel_size=2.*must equal the world size "
                                            r"8.*set data_parallel_size = .* = 1"):
        _hcp().resolve(8)
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        _hcp(hierarchical_context_parallel_sizes=[4, 2]).resolve()
    with pytest.raises(ValueError, match="order="):
        _hcp().resolve(order="pp-dp")


def test_expert_sizes_and_rank_offset_reach_every_group():
    topo = _hcp(data_parallel_size=4, tensor_model_parallel_size=1).resolve(
        rank_offset=16, expert_model_parallel_size=4, expert_tensor_parallel_size=2)
    assert topo.expert_tp == 2 and topo.expert_sizes["dp"] == 2
    ranks = sorted(r for g in topo.groups["cp"] for r in g)
    assert ranks == list(range(16, 32))
    assert all(len(g) == 4 for g in topo.groups["ep"])
    assert min(r for g in topo.groups["expt_dp"] for r in g) == 16


@pytest.mark.parametrize("a2a", [None, 2, 4])
def test_dynamic_blocks_and_levels_follow_one_rule(a2a):
    kw = dict(context_parallel_size=4, data_parallel_size=2, dynamic_context_parallel=True,
              max_seqlen_per_dp_cp_rank=256, num_attention_heads=8,
              min_dynamic_context_parallel_size=2)
    if a2a:
        kw.update(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[a2a, 4 // a2a])
    config = CPConfig(**kw)
    topo = config.resolve()
    assert topo.dynamic and topo.dynamic_min_size == 2
    assert topo.dynamic_sizes == [2, 4, 8]
    for size, blocks in topo.dynamic_blocks.items():
        assert blocks == dynamic_cp_blocks(topo.groups["dp_cp"][0], 2)[size]
    expected_a2a = config.a2a_size if a2a else None
    assert topo.dynamic_a2a_size == expected_a2a
    for size in topo.dynamic_sizes:
        levels = topo.dynamic_levels(size)
        assert levels == dynamic_levels(size, expected_a2a) == config.dynamic_levels(size)
        assert math.prod(levels) == size
        groups = topo.dynamic_level_groups(topo.dynamic_blocks[size][0])
        if levels[0] == 1 or levels[1] == 1:  # a flat ring, or pure a2a: no levels
            assert groups is None
        else:
            a2a_groups, p2p_groups = groups
            assert [len(g) for g in a2a_groups] == [levels[0]] * levels[1]
            assert [len(g) for g in p2p_groups] == [levels[1]] * levels[0]
    assert topo.describe_levels(8) == ("p2p 8" if not a2a else
                                       f"a2a {config.a2a_size} x p2p {8 // config.a2a_size}")


def test_a_static_topology_has_no_dynamic_groups():
    topo = _hcp().resolve()
    assert not topo.dynamic and topo.dynamic_blocks == {} and topo.dynamic_sizes == []
    assert topo.dynamic_level_groups([0, 1, 2, 3]) is None
