"""Projected step time: compute at a FLOP rate plus exposed CP ring traffic."""

from __future__ import annotations

import pytest

from megatron_hcp.dynamic_cp.projection import (
    Hardware,
    plan_seconds,
    projected_seconds,
    static_cp_seconds,
)
from megatron_hcp.dynamic_cp.scheduler import Group, MicroBatch, Plan
from megatron_hcp.dynamic_cp.workload import GPTWorkload

W = GPTWorkload(num_layers=3, hidden_size=256, num_attention_heads=4, num_query_groups=2)
NO_COMM = Hardware(bytes_per_second=float("inf"), latency_seconds=0.0)


def test_one_rank_is_compute_only():
    hw = Hardware(flops_per_second=1e12)
    assert projected_seconds(W, 1000, 1, hw) == pytest.approx(W.cost(1000, 1) / 1e12)


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_without_communication_it_is_the_flops_model(c):
    assert projected_seconds(W, 4096, c, NO_COMM) == pytest.approx(
        W.cost(4096, c) / NO_COMM.flops_per_second)


def test_exposed_ring_traffic_by_hand():
    # attention free (infinite FLOP rate): every ring step is fully exposed
    hw = Hardware(flops_per_second=float("inf"), bytes_per_second=1e9, latency_seconds=1e-5,
                  bytes_per_element=2)
    length, c = 800, 4
    kv_hidden = 2 * (256 // 4)  # 2 KV groups of head dim 64
    chunk = 2 * (length / c) * kv_hidden * 2  # K and V, bf16
    per_layer = (c - 1) * ((1e-5 + chunk / 1e9) + (1e-5 + 2 * chunk / 1e9))
    assert projected_seconds(W, length, c, hw) == pytest.approx(3 * per_layer)


def test_long_sequences_hide_the_ring_behind_attention():
    hw = Hardware(flops_per_second=1e12, bytes_per_second=1e12, latency_seconds=1e-6)
    assert projected_seconds(W, 65536, 4, hw) == pytest.approx(W.cost(65536, 4) / 1e12)
    assert projected_seconds(W, 64, 4, hw) > W.cost(64, 4) / 1e12


def test_plan_and_static_seconds():
    hw = Hardware()
    lengths = [100, 200, 300]
    plan = Plan((MicroBatch((Group((0, 1), (0, 1)),)), MicroBatch((Group((0,), (2,)),
                                                                  Group((1,), ())))))
    want = (projected_seconds(W, 100, 2, hw) + projected_seconds(W, 200, 2, hw)
            + projected_seconds(W, 300, 1, hw))
    assert plan_seconds(plan, lengths, W, hw) == pytest.approx(want)
    replicas = [[0, 1], [2]]
    assert static_cp_seconds(replicas, lengths, 2, W, hw) == pytest.approx(max(
        projected_seconds(W, 100, 2, hw) + projected_seconds(W, 200, 2, hw),
        projected_seconds(W, 300, 2, hw)))


def test_seq_squared_has_no_seconds():
    with pytest.raises(ValueError, match="mode='flops'"):
        projected_seconds(GPTWorkload(mode="seq_squared"), 10, 2, Hardware())


# ------------------------------------------- dynamic (hierarchical) CP on two link classes
from megatron_hcp.dynamic_cp.projection import (  # noqa: E402
    Cluster,
    cp_layer_seconds,
    dynamic_group_seconds,
    dynamic_levels,
)

GQA = GPTWorkload(num_layers=4, hidden_size=4096, ffn_hidden_size=14336, gated_mlp=True,
                  num_attention_heads=32, num_query_groups=8)  # 8B-like, 8 KV heads
NODE8 = Cluster(gpus_per_node=8)


def _comm(w, length, ranks, cluster, a2a=None):
    return dynamic_group_seconds(w, length, ranks, cluster, a2a) - (
        w.cost(length, len(ranks)) / cluster.flops_per_second)


@pytest.mark.parametrize("c, a, levels", [(1, 8, (1, 1)), (4, 8, (4, 1)), (8, 8, (8, 1)),
                                          (16, 8, (8, 2)), (64, 4, (4, 16)), (16, None, (1, 16))])
def test_dynamic_levels(c, a, levels):
    assert dynamic_levels(c, a) == levels


def test_pure_a2a_group_inside_a_node_has_no_ring_term():
    length, c = 32768, 8
    # by hand: Q, K, V before and O after attention, (c-1)/c of it over NVLink, fwd and bwd
    held = (length / c) * GQA.head_dim * (2 * 32 + 2 * 8) * 2
    a2a = 5e-6 + held * (c - 1) / c / 450e9
    assert _comm(GQA, length, range(c), NODE8, 8) == pytest.approx(GQA.num_layers * 2 * a2a)
    # nothing of it crosses a node or rides a ring: the inter-node link does not matter
    slow_ib = Cluster(gpus_per_node=8, inter_bytes_per_second=1e6, inter_latency_seconds=1.0)
    assert _comm(GQA, length, range(c), slow_ib, 8) == _comm(GQA, length, range(c), NODE8, 8)
    # a group of 4 under a2a 8 is pure a2a over 4
    assert _comm(GQA, length, range(4), NODE8, 8) == pytest.approx(GQA.num_layers * 2 * (
        5e-6 + (length / 4) * GQA.head_dim * 80 * 2 * 3 / 4 / 450e9))


def test_a_group_across_nodes_pays_the_inter_node_link():
    free_attention = Cluster(gpus_per_node=8, flops_per_second=float("inf"))
    length = 65536
    # flat ring of 16 ranks on two nodes: 15 steps at the IB rate (slowest hop), fully exposed
    chunk = 2 * (length / 16) * 8 * GQA.head_dim * 2
    step = (10e-6 + chunk / 50e9) + (10e-6 + 2 * chunk / 50e9)
    assert _comm(GQA, length, range(16), free_attention, None) == pytest.approx(
        GQA.num_layers * 15 * step)
    # the same ring inside one node (8 ranks) runs on NVLink
    chunk8 = 2 * (length / 8) * 8 * GQA.head_dim * 2
    step8 = (5e-6 + chunk8 / 450e9) + (5e-6 + 2 * chunk8 / 450e9)
    assert _comm(GQA, length, range(8), free_attention, None) == pytest.approx(
        GQA.num_layers * 7 * step8)
    # HCP [8, 2]: its ring crosses the nodes too; slower IB makes both groups slower
    slower = Cluster(gpus_per_node=8, inter_bytes_per_second=10e9)
    for a2a in (None, 8):
        assert _comm(GQA, length, range(16), slower, a2a) > _comm(GQA, length, range(16),
                                                                     NODE8, a2a)
    # ... but not a group inside a node
    assert _comm(GQA, length, range(8), slower, None) == _comm(GQA, length, range(8), NODE8)


def test_hcp_levels_are_priced_by_cp_layer_seconds():
    length, ranks = 131072, range(32)
    layer = cp_layer_seconds(GQA, NODE8, length, 1, "a2a+p2p", ranks, a2a_ranks=range(8),
                             p2p_ranks=range(0, 32, 8))
    assert _comm(GQA, length, ranks, NODE8, 8) == pytest.approx(
        GQA.num_layers * (layer.forward + layer.backward))


@pytest.mark.parametrize("length, c", [(131072, 16), (1 << 20, 64), (1 << 20, 256)])
def test_hcp_beats_a_flat_inter_node_ring_on_long_sequences_with_few_kv_heads(length, c):
    flat = dynamic_group_seconds(GQA, length, range(c), NODE8)
    hcp = dynamic_group_seconds(GQA, length, range(c), NODE8, 8)
    assert hcp < flat
    # a group inside one node: flat and HCP do not cross nodes; no inter-node ring to save
    assert _comm(GQA, length, range(8), NODE8, 8) > 0


def test_static_hcp_and_plan_seconds_on_a_cluster():
    lengths = [4096, 8192, 70000]
    plan = Plan((MicroBatch((Group(tuple(range(8)), (0, 1)), Group(tuple(range(8, 16)), ()))),
                 MicroBatch((Group(tuple(range(16)), (2,)),))))
    want = max(dynamic_group_seconds(GQA, 4096, range(8), NODE8, 4)
               + dynamic_group_seconds(GQA, 8192, range(8), NODE8, 4), 0.0) + (
        dynamic_group_seconds(GQA, 70000, range(16), NODE8, 4))
    assert plan_seconds(plan, lengths, GQA, NODE8, 4) == pytest.approx(want)
    replicas = [[0, 1], [2]]
    assert static_cp_seconds(replicas, lengths, 16, GQA, NODE8, 8) == pytest.approx(max(
        dynamic_group_seconds(GQA, 4096, range(16), NODE8, 8)
        + dynamic_group_seconds(GQA, 8192, range(16), NODE8, 8),
        dynamic_group_seconds(GQA, 70000, range(16, 32), NODE8, 8)))
    with pytest.raises(ValueError, match="hcp_a2a_size=4 needs a two-link Cluster"):
        plan_seconds(plan, lengths, GQA, Hardware(), 4)


def test_node_not_a_power_of_two_prices_the_straddling_block():
    odd = Cluster(gpus_per_node=6)
    # ranks 4..7 straddle nodes 0 and 1, ranks 0..3 do not
    assert dynamic_group_seconds(GQA, 8192, range(4, 8), odd) > dynamic_group_seconds(
        GQA, 8192, range(0, 4), odd)


def test_a2a_level_above_the_kv_heads_prices_the_replicated_heads():
    two_kv = GPTWorkload(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2)
    four_kv = GPTWorkload(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=4)
    for ranks in (range(4), range(16)):  # pure a2a 4; a2a 4 x p2p 4 across two nodes
        assert _comm(two_kv, 8192, ranks, NODE8, 4) == pytest.approx(
            _comm(four_kv, 8192, ranks, NODE8, 4))
    assert _comm(two_kv, 8192, range(16), NODE8, 2) < _comm(four_kv, 8192, range(16), NODE8, 2)
