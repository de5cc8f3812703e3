"""THD sharding never truncates: an unpadded sequence length is refused at every entry point."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.attention.reference import (
    CPAttentionError,
    assemble_from_chunks,
    get_local_chunk,
    pad_thd,
    thd_partition_indices,
)

CU = torch.tensor([0, 13, 43, 50])  # lengths [13, 30, 7]: none a multiple of 2*4
X = torch.arange(50.0).unsqueeze(-1)


@pytest.mark.parametrize("shard", [
    lambda: get_local_chunk(X, 4, 1, "thd", cu_seqlens_padded=CU),
    lambda: thd_partition_indices(CU, 4, 0),
    lambda: assemble_from_chunks([X[:12]] * 4, "thd", cu_seqlens_padded=CU),
])
def test_unpadded_lengths_are_refused_naming_sequence_length_and_pad_thd(shard):
    with pytest.raises(CPAttentionError) as info:
        shard()
    message = str(info.value)
    assert "sequence 0 has length 13" in message and "pad_thd" in message


def test_labels_sharded_after_pad_thd_keep_every_token():
    padded, cu_pad = pad_thd(X, CU, 4)
    shards = [get_local_chunk(padded, 4, r, "thd", cu_seqlens_padded=cu_pad) for r in range(4)]
    assert sum(s.shape[0] for s in shards) == int(cu_pad[-1])
    assert torch.equal(assemble_from_chunks(shards, "thd", cu_seqlens_padded=cu_pad), padded)
    kept = torch.cat(shards).flatten()
    assert set(X.flatten().tolist()) <= set(kept.tolist())


@pytest.mark.parametrize("cp_size, cp_rank", [(4, 4), (4, -1), (0, 0)])
def test_cp_position_out_of_range_is_refused(cp_size, cp_rank):
    with pytest.raises(CPAttentionError, match="cp_rank|cp_size=0"):
        get_local_chunk(torch.zeros(1, 16, 2), cp_size, cp_rank, "bshd")


def test_padded_length_for_sequence_parallelism():
    """Under SP each rank's tokens split over the TP ranks: padding to 2 * cp * tp keeps every
    rank's share divisible by tp."""
    from megatron_hcp.sharding import padded_length

    assert [padded_length(n, 2) for n in (1, 4, 5)] == [4, 4, 8]
    assert [padded_length(n, 2, 2) for n in (1, 8, 9)] == [8, 8, 16]
    assert padded_length(3, 1, 4) == 8
    with pytest.raises(ValueError, match="multiple=0"):
        padded_length(3, 1, 0)
