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
