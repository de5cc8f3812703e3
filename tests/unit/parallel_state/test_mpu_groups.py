"""Real 8-rank gloo runs: our builder and megatron's initialize_model_parallel agree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.config import CPConfigError
from megatron_hcp.harness.local_world import RankError
from megatron_hcp.parallel_state.groups import create_hierarchical_groups, destroy_groups
from megatron_hcp.parallel_state.layout import ParallelLayout
from megatron_hcp.parallel_state.mpu import (
    destroy_model_parallel,
    initialize_model_parallel,
    verify_against_layout,
)
from megatron_hcp.parallel_state.selfcheck import check_mpu_groups

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

WORLD = 8

CASES = [
    # (tp, cp, pp, hcp sizes, order)
    (2, 4, 1, [2, 2], "tp-cp-ep-dp-pp"),
    (1, 8, 1, [4, 2], "tp-cp-ep-dp-pp"),
    (1, 8, 1, [2, 4], "tp-cp-ep-dp-pp"),
    (1, 4, 1, [2, 2], "tp-cp-ep-dp-pp"),  # DP2
    (1, 4, 2, [2, 2], "tp-cp-ep-dp-pp"),  # PP2
    (2, 2, 1, [2, 1], "tp-cp-ep-pp-dp"),
    (1, 4, 1, [2, 2], "tp-cp-ep-pp-dp"),  # megatron refuses CP>1 with PP>1 in this order
]


def _config(tp, cp, pp, hcp):
    return dict(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=WORLD // (tp * cp * pp),
        cp_comm_type="a2a+p2p",
        hierarchical_context_parallel_sizes=hcp,
    )


def compare_builders(tp, cp, pp, hcp, order):
    """On one rank: our groups vs megatron's groups, members and an all-reduce per level."""
    from megatron.core import parallel_state as ps

    from megatron_hcp.config import CPConfig

    rank = dist.get_rank()
    layout = ParallelLayout(world_size=WORLD, tp=tp, cp=cp, pp=pp, order=order,
                            hierarchical_sizes=tuple(hcp))
    ours = create_hierarchical_groups(layout.groups["cp"], hcp)
    initialize_model_parallel(CPConfig(**_config(tp, cp, pp, hcp)), order=order,
                              create_gloo_process_groups=False)
    try:
        theirs = ps.get_hierarchical_context_parallel_groups()
        out = []
        for level, (a, b) in enumerate(zip(ours, theirs)):
            members = dist.get_process_group_ranks(a)
            assert members == dist.get_process_group_ranks(b), (level, members)
            assert members == layout.hcp_of(rank)[level]
            x = torch.tensor([rank + 1], dtype=torch.int64)
            y = x.clone()
            dist.all_reduce(x, group=a)
            dist.all_reduce(y, group=b)
            assert int(x) == int(y) == sum(m + 1 for m in members)
            out.append(members)
        assert len(out) == 2
        return out
    finally:
        destroy_model_parallel()
        destroy_groups(ours)


@pytest.mark.parametrize("tp, cp, pp, hcp, order", CASES)
def test_our_groups_equal_megatron_groups(world, tp, cp, pp, hcp, order):
    results = world.run(compare_builders, tp, cp, pp, hcp, order)
    layout = ParallelLayout(world_size=WORLD, tp=tp, cp=cp, pp=pp, order=order,
                            hierarchical_sizes=tuple(hcp))
    assert results == [layout.hcp_of(r) for r in range(WORLD)]


def test_selfcheck_sums_and_log_lines(world):
    results = world.run(check_mpu_groups, _config(2, 4, 1, [2, 2]))
    for result in results:
        for got, want, _ in result["checks"].values():
            assert got == want
    lines = results[0]["lines"]
    assert lines[1] == ("HIERARCHICAL_CONTEXT_PARALLEL_GROUPS created: cp=4 a2a(level 0)=2 "
                        "[[0,2],[4,6],[1,3],[5,7]] p2p(level 1)=2 [[0,4],[2,6],[1,5],[3,7]]")
    flat = world.run(check_mpu_groups, dict(context_parallel_size=4, data_parallel_size=2))
    assert flat[0]["lines"] == ["CONTEXT_PARALLEL_GROUP created: cp=4 [[0,1,2,3],[4,5,6,7]]"]


def init_with_bad_config():
    from megatron_hcp.config import CPConfig

    initialize_model_parallel(CPConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                                       data_parallel_size=2))


def test_bad_config_raises_on_every_rank_before_any_collective(world):
    with pytest.raises(RankError) as info:
        world.run(init_with_bad_config)
    assert sorted(info.value.errors) == list(range(WORLD))
    assert all(name == "CPConfigError" for name, _ in info.value.errors.values())
    # The world is still healthy: nothing was left half-way in a collective.
    assert world.run(dist.get_rank) == list(range(WORLD))


def init_then_verify_wrong_layout():
    from megatron.core import parallel_state as ps

    from megatron_hcp.config import CPConfig

    initialize_model_parallel(CPConfig(**_config(2, 4, 1, [2, 2])),
                              create_gloo_process_groups=False)
    try:
        hcp = (4, 1) if dist.get_rank() == 3 else (2, 2)
        layout = ParallelLayout(world_size=WORLD, tp=2, cp=4, hierarchical_sizes=hcp)
        verify_against_layout(ps, layout)
    finally:
        destroy_model_parallel()


def test_layout_mismatch_is_an_error_on_all_ranks_not_a_hang(world):
    with pytest.raises(RankError) as info:
        world.run(init_then_verify_wrong_layout, timeout_s=60)
    assert sorted(info.value.errors) == list(range(WORLD))
    assert all(name == "LayoutMismatchError" for name, _ in info.value.errors.values())
    assert "ranks [3] computed a different layout" in info.value.errors[0][1]


def init_with_wrong_world_size():
    from megatron_hcp.config import CPConfig

    try:
        initialize_model_parallel(CPConfig(context_parallel_size=4))  # dp=1: covers 4 of 8
    except CPConfigError as err:
        return [v.parameter for v in err.violations], str(err)


def test_world_size_mismatch_names_data_parallel_size(world):
    for params, message in world.run(init_with_wrong_world_size):
        assert params == ["data_parallel_size"]
        assert "data_parallel_size = world_size / (tp * pp * cp) = 2" in message
