"""One rule for ``cu_seqlens`` in every public sharding and attention function: an integer 1-D
tensor with values, starting at 0, non-decreasing, covering exactly the tokens given; and
``cp_size >= 1``. Before, tokens were dropped or shifted silently (``get_local_chunk`` with
``[0, 8]`` on 16 tokens, ``pad_thd`` with ``[2, 5, 7]`` or ``[0, 3]`` on 7 tokens, cp_size 0 or
-4 padded as for CP 1, float offsets truncated) or the call ended in torch's own errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hcp.attention.reference import local_attention
from megatron_hcp.dynamic_cp.scheduler import schedule
from megatron_hcp.dynamic_cp.workload import ScheduleError, min_group_size
from megatron_hcp.sharding import (
    ShardingError,
    assemble_from_chunks,
    cu_seqlens_values,
    get_local_chunk,
    pad_thd,
    padded_length,
    seq_lengths,
    thd_partition_indices,
)

X16 = torch.arange(16.0)
X7 = torch.arange(7.0)


@pytest.mark.parametrize("call, words", [
    (lambda: get_local_chunk(X16, 2, 0, "thd", torch.tensor([0, 8])), "ends at 8"),
    (lambda: pad_thd(X7, torch.tensor([2, 5, 7]), 2), "starts at 2"),
    (lambda: pad_thd(X7, torch.tensor([0, 3]), 2), "ends at 3"),
    (lambda: pad_thd(X7, torch.tensor([0, 7]), 0), "cp_size=0"),
    (lambda: pad_thd(X7, torch.tensor([0, 7]), -4), "cp_size=-4"),
    (lambda: pad_thd(X16, torch.tensor([0.0, 2.5, 16.0]), 2), "dtype torch.float32"),
    (lambda: pad_thd(X16, torch.tensor([0, 2, 20]), 2), "ends at 20"),
    (lambda: pad_thd(X16, torch.tensor([0, 5, 2, 16]), 2), "decreases at entry 2"),
    (lambda: pad_thd(X16, [0, 16], 2), "is a list"),
    (lambda: pad_thd(X16, torch.tensor([[0, 16]]), 2), "shape [1, 2]"),
    (lambda: pad_thd(X16, torch.tensor([0, 16], device="meta"), 2), "meta device"),
    (lambda: pad_thd(X16, torch.tensor([True, False]), 2), "dtype torch.bool"),
    (lambda: thd_partition_indices(torch.tensor([0.0, 8.0]), 2, 0), "dtype"),
    (lambda: padded_length(5, 0), "cp_size=0"),
    (lambda: get_local_chunk(X16.view(1, 16), 4, True, "bshd"), "cp_rank=True"),
    (lambda: assemble_from_chunks([X16[:4]] * 3, "thd", torch.tensor([0, 16])),
     "not a multiple of 6"),
    (lambda: assemble_from_chunks([X16[:4], X16[:4], X16[:4], X16[:2]], "thd",
                                  torch.tensor([0, 16])), "chunk 3 of 4 holds 2 tokens"),
    (lambda: assemble_from_chunks([], "bshd"), "non-empty list"),
    (lambda: assemble_from_chunks([torch.zeros(1, 4, 2), torch.zeros(1, 4, 3)], "bshd"),
     "differ only in sequence length"),
    (lambda: assemble_from_chunks([torch.zeros(1, 3, 2)] * 2, "bshd"), "two equal halves"),
])
def test_each_reported_case_is_a_named_error(call, words):
    with pytest.raises(ShardingError) as info:
        call()
    assert words in str(info.value)


Q = torch.randn(8, 2, 4)


@pytest.mark.parametrize("kwargs, words", [
    ({"cu_seqlens_q": torch.tensor([0.0, 2.5, 8.0])}, "cu_seqlens_q has dtype"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 8]),
      "cu_seqlens_q_padded": torch.tensor([[0, 3, 8]])}, "cu_seqlens_q_padded has shape"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 8], device="meta")}, "meta"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 8]), "softmax_scale": 0.0}, "softmax_scale=0.0"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 8]), "softmax_scale": -1.0}, "softmax_scale=-1.0"),
    ({"cu_seqlens_q": torch.tensor([0, 3, 8]), "softmax_scale": math.nan}, "softmax_scale=nan"),
])
def test_local_attention_refuses_what_it_would_misread(kwargs, words):
    with pytest.raises(ShardingError) as info:
        local_attention(Q, Q, Q, qkv_format="thd", **kwargs)
    assert words in str(info.value)


def test_attention_refuses_mixed_dtypes_and_empty_head_dims():
    with pytest.raises(ShardingError, match="must share one dtype"):
        local_attention(Q, Q.double(), Q, qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]))
    empty = Q[..., :0]
    with pytest.raises(ShardingError, match="head dim 0"):
        local_attention(empty, empty, empty, qkv_format="thd",
                        cu_seqlens_q=torch.tensor([0, 8]))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), cp=st.integers(1, 4),
       shift=st.integers(-3, 3), mode=st.sampled_from(["zigzag", "contiguous"]))
def test_valid_packings_round_trip_and_any_other_total_is_refused(lengths, cp, shift, mode):
    """Property: for cumulative lengths that cover the tensor, pad_thd keeps every token and
    the CP chunks reassemble it exactly; a total off by ``shift`` tokens is always refused."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.arange(float(sum(lengths)))
    padded, cu_pad = pad_thd(x, cu, cp, cp_partition_mode=mode)
    assert seq_lengths(cu) == lengths
    kept = torch.cat([padded[int(cu_pad[i]):int(cu_pad[i]) + n] for i, n in enumerate(lengths)])
    assert torch.equal(kept, x)
    chunks = [get_local_chunk(padded, cp, r, "thd", cu_pad, cp_partition_mode=mode)
              for r in range(cp)]
    assert torch.equal(assemble_from_chunks(chunks, "thd", cu_pad, cp_partition_mode=mode),
                       padded)
    if shift:
        if sum(lengths) + shift < 0:
            return
        y = torch.arange(float(sum(lengths) + shift))
        with pytest.raises(ShardingError, match="ends at"):
            pad_thd(y, cu, cp, cp_partition_mode=mode)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-5, 20), min_size=1, max_size=6))
def test_the_rule_accepts_exactly_non_decreasing_offsets_from_zero(values):
    cu = torch.tensor(values, dtype=torch.int64)
    good = values[0] == 0 and all(b >= a for a, b in zip(values, values[1:]))
    if good:
        assert cu_seqlens_values(cu, tokens=values[-1]) == values
    else:
        with pytest.raises(ShardingError):
            cu_seqlens_values(cu)


@pytest.mark.parametrize("call, words", [
    (lambda: schedule([100], 2**20, 128), "dp_cp"),
    (lambda: schedule([100], 2**40, 128), "dp_cp"),
    (lambda: schedule([100] * 100_000, 8, 128), "100000 sequences"),
    (lambda: schedule([2**27], 8, 128), "lengths[0]"),
    (lambda: schedule([100], 8, 2**27), "max_seqlen_per_rank"),
    (lambda: schedule([100], 8, 128, vpp=10**9), "vpp"),
    (lambda: schedule(iter([100]), 8, 128), "give a list"),
])
def test_the_schedule_api_shares_the_clis_bounds(call, words):
    """schedule([100], 2**20, 128) ran for minutes; 2**40 was a bare MemoryError; 100,000
    sequences were accepted (the documented limit is 65,536)."""
    with pytest.raises(ScheduleError) as info:
        call()
    assert words in str(info.value)


def test_padding_not_ranks_is_named_when_it_is_the_cause():
    with pytest.raises(ScheduleError, match="the padding, not the number of ranks") as info:
        min_group_size(1, 1, 16384)
    assert "raise the cap to >= 2" in str(info.value)
    with pytest.raises(ScheduleError, match="needs more than 16 ranks"):
        min_group_size(100, 1, 16)
