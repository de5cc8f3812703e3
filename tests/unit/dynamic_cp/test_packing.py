"""THD packing of variable-length samples for a CP rank (pure)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hcp.dynamic_cp.packing import pack_thd
from megatron_hcp.sharding import assemble_from_chunks, padded_length
from megatron_hcp.training.data import varlen_lengths, varlen_sample


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_pack_thd_cuts_the_padded_sequences_for_every_rank(cp):
    lengths = [5, 16, 9]
    samples = [varlen_sample(3, 0, i, n, 50) for i, n in enumerate(lengths)]
    parts = [pack_thd(samples, cp, r) for r in range(cp)]
    params = parts[0].packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 5, 21, 30]
    padded = [padded_length(n, cp) for n in lengths]
    assert all(p % (2 * cp) == 0 and p >= n for p, n in zip(padded, lengths))
    assert params.cu_seqlens_q_padded.tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert params.max_seqlen_q == max(padded) and params.local_cp_size is None
    full = assemble_from_chunks([p.tokens[0] for p in parts], "thd", params.cu_seqlens_q_padded)
    mask = assemble_from_chunks([p.loss_mask[0] for p in parts], "thd",
                                params.cu_seqlens_q_padded)
    start = 0
    for sample, n, p in zip(samples, lengths, padded):
        assert torch.equal(full[start:start + n], sample[0])
        assert torch.equal(mask[start:start + n], sample[2].float())
        assert not mask[start + n:start + p].any()  # padding never counts in the loss
        start += p


@pytest.mark.parametrize("cp", [2, 4])
def test_pack_thd_in_the_contiguous_layout(cp, monkeypatch):
    """Sequences padded to a multiple of cp (not 2cp), rank r holding slice r of each; on a
    megatron-core whose PackedSeqParams has upstream's cp_partition_mode field the layout
    travels on it (and the attention reads it there); on 0.16/0.19 it has no such field."""
    import dataclasses

    import megatron.core.packed_seq_params as psp

    from megatron_hcp.attention.partition import partition_mode
    from megatron_hcp.dynamic_cp.packing import carries_partition_mode

    lengths = [5, 16, 9]
    samples = [varlen_sample(3, 0, i, n, 50) for i, n in enumerate(lengths)]
    parts = [pack_thd(samples, cp, r, cp_partition_mode="contiguous") for r in range(cp)]
    cu_pad = parts[0].packed_seq_params.cu_seqlens_q_padded
    padded = [padded_length(n, cp, cp_partition_mode="contiguous") for n in lengths]
    assert cu_pad.diff().tolist() == padded and all(p % cp == 0 for p in padded)
    assert padded != [padded_length(n, cp) for n in lengths]  # less than zigzag's
    full = assemble_from_chunks([p.tokens[0] for p in parts], "thd", cu_pad,
                                cp_partition_mode="contiguous")
    start = 0
    for sample, n, p in zip(samples, lengths, padded):
        assert torch.equal(full[start:start + n], sample[0])
        start += p
    c = padded[0] // cp  # rank 1 holds positions c .. 2c-1 of sequence 0 (of 5 real tokens)
    real = min(5, 2 * c) - c
    assert real > 0 and torch.equal(parts[1].tokens[0][:real], samples[0][0][c:c + real])
    assert not carries_partition_mode(psp.PackedSeqParams)

    @dataclasses.dataclass
    class UpstreamParams(psp.PackedSeqParams):
        cp_partition_mode: str = "zigzag"

    monkeypatch.setattr(psp, "PackedSeqParams", UpstreamParams)
    params = pack_thd(samples, cp, 0, cp_partition_mode="contiguous").packed_seq_params
    assert params.cp_partition_mode == "contiguous" and partition_mode(None, params) == (
        "contiguous")


def test_dynamic_pack_carries_its_group_and_size():
    sample = varlen_sample(3, 0, 0, 7, 50)
    one = pack_thd([sample], 1, 0, dynamic=True).packed_seq_params
    assert one.local_cp_size == 1 and one.cp_group is None
    marker = object()
    two = pack_thd([sample], 2, 1, marker, dynamic=True).packed_seq_params
    assert two.local_cp_size == 2 and two.cp_group is marker


def test_varlen_data_is_deterministic_and_bounded():
    a = varlen_lengths(1, 2, 64, min_len=8, max_len=100, mean=30, sigma=1.2)
    assert a == varlen_lengths(1, 2, 64, min_len=8, max_len=100, mean=30, sigma=1.2)
    assert min(a) >= 8 and max(a) <= 100 and len(set(a)) > 10
    s = varlen_sample(1, 2, 5, 20, 50)
    assert s.shape == (3, 20) and torch.equal(s, varlen_sample(1, 2, 5, 20, 50))
    assert torch.equal(s[1, :-1], s[0, 1:])  # labels are the next tokens


def test_markov_corpus_follows_its_successor_table():
    """The main job's corpus: deterministic, and each token is followed by its fixed successor
    about MARKOV_STAY of the time (what makes the loss fall); the table is the same every step."""
    from megatron_hcp.training.data import MARKOV_STAY, markov_sample

    a, b = markov_sample(1, 0, 3, 400, 128), markov_sample(1, 7, 9, 400, 128)
    assert torch.equal(a, markov_sample(1, 0, 3, 400, 128)) and not torch.equal(a[0], b[0])
    assert torch.equal(a[0, 1:], a[1, :-1]) and a[2, :2].sum() == 0 and a[2, 2:].all()
    succ: dict[int, list[int]] = {}
    for s in (a, b):
        for t, n in zip(s[0].tolist(), s[1].tolist()):
            succ.setdefault(t, []).append(n)
    top = sum(max(nxt.count(x) for x in nxt) for nxt in succ.values())
    assert abs(top / sum(map(len, succ.values())) - MARKOV_STAY) < 0.06


def test_micro_batches_move_whole_to_the_compute_device():
    """The GPU path moves tokens, labels, mask, positions and the packed-sequence boundaries
    (checked with the meta device: no GPU here); the CPU path returns the batch untouched, and
    asking for CUDA where there is none is a named error."""
    import pytest

    from megatron_hcp.dynamic_cp.packing import pack_thd
    from megatron_hcp.training.trainer import TinyGPTSpec, _device

    mb = pack_thd([varlen_sample(3, 0, i, n, 50) for i, n in enumerate((5, 9))], 2, 1)
    assert mb.to(torch.device("cpu")) is mb and mb.to("cpu") is mb
    moved = mb.to(torch.device("meta"))
    tensors = [moved.tokens, moved.labels, moved.loss_mask, moved.position_ids,
               *(v for v in vars(moved.packed_seq_params).values() if torch.is_tensor(v))]
    assert len(tensors) >= 8 and all(t.device.type == "meta" for t in tensors)
    assert mb.packed_seq_params.cu_seqlens_q.device.type == "cpu"  # the original is untouched
    assert moved.to("meta") is moved  # already there: nothing copied
    # a batch without packed-sequence boundaries (fixed-length rows) moves too
    plain = dataclasses.replace(mb, packed_seq_params=None).to("meta")
    assert plain.packed_seq_params is None and plain.tokens.device.type == "meta"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            _device(TinyGPTSpec(device="cuda"))
