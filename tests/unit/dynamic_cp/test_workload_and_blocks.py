"""Workload model and dynamic DPxCP block layout (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state as ps

from megatron_hcp.dynamic_cp.workload import (
    GPTWorkload,
    ScheduleError,
    min_group_size,
    tokens_per_rank,
)
from megatron_hcp.parallel_state.layout import dynamic_cp_blocks


def test_tokens_per_rank_pads_to_2c():
    assert tokens_per_rank(100, 4) == 26  # padded to 104, 104 / 4
    assert tokens_per_rank(96, 4) == 24
    assert tokens_per_rank(1, 1) == 2


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 100_000), cap=st.integers(1, 8192),
       log_world=st.integers(0, 8), log_min=st.integers(0, 3))
def test_min_group_size_is_the_smallest_that_fits(length, cap, log_world, log_min):
    world, min_size = 2**log_world, min(2**log_min, 2**log_world)
    try:
        c = min_group_size(length, cap, world, min_size)
    except ScheduleError as err:
        assert tokens_per_rank(length, world) > cap and "raise the cap" in str(err)
        return
    assert c >= min_size and c & (c - 1) == 0 and tokens_per_rank(length, c) <= cap
    assert c == min_size or tokens_per_rank(length, c // 2) > cap


def test_bad_cap_is_named():
    with pytest.raises(ScheduleError, match="max_seqlen_per_dp_cp_rank=0"):
        min_group_size(10, 0, 8)


def test_flops_count_matches_an_explicit_matmul_count():
    w = GPTWorkload(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=8,
                    num_query_groups=2)
    h, kv, f, layers, length = 64, 2 * 8, 256, 2, 100
    matmuls = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (f, h)]  # q, k, v, proj, fc1, fc2
    linear = sum(2 * a * b for a, b in matmuls) * length
    attention = 2 * (2 * length * length * h) / 2  # QK^T and PV, causal half
    assert w.cost(length, 1) == pytest.approx(3 * layers * (linear + attention))
    assert w.cost(length, 4) == pytest.approx(w.cost(length, 1) / 4)


def test_linear_layers_dominate_below_12x_hidden():
    w = GPTWorkload(hidden_size=1024)  # MHA, ffn 4h
    per_token = w.linear_flops_per_token()
    assert w.attention_flops(12 * 1024) / (12 * 1024) == pytest.approx(per_token)
    assert w.attention_flops(6 * 1024) < 6 * 1024 * per_token


def test_seq_squared_mode_is_upstreams_model():
    assert GPTWorkload(mode="seq_squared").cost(1000, 4) == 250_000


def megatron_hybrid_blocks(ranks):
    """megatron-core 0.16.1's create_hybrid_dp_cp_groups arithmetic, recorded."""
    created = []
    original = ps.create_group
    ps.create_group = lambda r, **kw: created.append(list(r)) or object()
    try:
        ps.create_hybrid_dp_cp_groups(-1, ranks, None)
    finally:
        ps.create_group = original
    out: dict[int, list] = {}
    for group in created:
        out.setdefault(len(group), []).append(group)
    return out


@pytest.mark.parametrize("n, offset", [(4, 0), (8, 0), (8, 8), (16, 3), (64, 0)])
def test_blocks_equal_megatron_where_both_define_them(n, offset):
    ranks = list(range(offset, offset + n))
    ours = dynamic_cp_blocks(ranks)
    theirs = megatron_hybrid_blocks(ranks)
    for size, groups in theirs.items():
        assert ours[size] == groups
    # ours also has size 1 (CP off for a micro-batch) and the whole group
    assert ours[1] == [[r] for r in ranks] and ours[n] == [ranks]
    assert sorted(ours) == [2**i for i in range(n.bit_length())]


def test_min_size_and_errors():
    assert sorted(dynamic_cp_blocks(list(range(8)), min_size=4)) == [4, 8]
    with pytest.raises(ValueError, match="power of two"):
        dynamic_cp_blocks(list(range(6)))
    with pytest.raises(ValueError, match="min_dynamic_context_parallel_size=3"):
        dynamic_cp_blocks(list(range(8)), min_size=3)
