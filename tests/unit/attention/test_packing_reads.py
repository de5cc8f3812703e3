"""The packing of a thd call is read on the host once per cu_seqlens tensor (packing.py): the
next layers find it; a new or in-place modified tensor is read again; bad packings raise at
every call."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch

from megatron_hcp.attention.reference import packing
from megatron_hcp.attention.reference.packing import KEPT_PACKINGS, packing_lengths
from megatron_hcp.attention.reference.seq_layout import CPAttentionError


def _reads(*args):
    """(lengths, host reads of the tensors' values) of one call: the reads happen in
    ``packing._read`` (its copy to the host is the synchronisation on a GPU; on the CPU the
    values are read by ``tolist``, which no op counter sees), so its calls are counted."""
    calls = []
    read = packing._read

    def counted(*a):
        calls.append(a)
        return read(*a)

    with mock.patch.object(packing, "_read", counted):
        lengths = packing_lengths(*args)
    return lengths, len(calls)


def test_a_packing_is_read_once_while_its_tensors_live_unmodified():
    """The next layer's call with the same tensors reads nothing (on the CPU the counter sees
    the reads of the check; on a GPU the copy to the host, a synchronisation, goes too)."""
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    pad = torch.tensor([0, 8, 16], dtype=torch.int32)
    first, reads = _reads(cu, cu, pad, pad, 2, "zigzag")
    assert first == ((8, 8), (5, 6)) and reads > 0
    again, reads = _reads(cu, cu, pad, pad, 2, "zigzag")  # the next layer: nothing read
    assert again == first and reads == 0
    assert _reads(cu, cu, pad, pad, 4, "zigzag")[1] > 0  # another CP size: checked again
    same_values = pad.clone()  # a new tensor is read again
    lengths, reads = _reads(cu, cu, same_values, same_values, 2, "zigzag")
    assert lengths == first and reads > 0
    pad[2] = 24  # written in place: read again, and the new packing counts
    assert _reads(cu, cu, pad, pad, 2, "zigzag")[0] == ((8, 16), (5, 6))


def test_bad_packings_raise_at_every_call():
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    pad = torch.tensor([0, 6, 12], dtype=torch.int32)  # 6 is no multiple of 2*cp = 4
    for _ in range(2):
        with pytest.raises(CPAttentionError, match="not a multiple of 2\\*cp_size=4"):
            packing_lengths(cu, cu, pad, pad, 2, "zigzag")
    other = torch.tensor([0, 4, 12], dtype=torch.int32)
    with pytest.raises(CPAttentionError, match="differ"):
        packing_lengths(cu, cu, pad, other, 1, "zigzag")


def test_a_dead_tensor_is_never_mistaken_for_a_new_one_and_few_are_kept():
    """An entry holds weak references: once its tensors are gone, a tensor that happens to get
    the same id is read afresh; at most KEPT_PACKINGS packings are kept."""
    def make(n):
        return torch.tensor([0, n], dtype=torch.int32)

    cu = make(4)
    packing_lengths(cu, cu, cu, cu, 1, "zigzag")
    dead = id(cu)
    del cu
    gc.collect()
    for n in range(2, 2 + 2 * KEPT_PACKINGS):  # new tensors, some may reuse the dead id
        cu = make(2 * n)
        lengths, reads = _reads(cu, cu, cu, cu, 1, "zigzag")
        assert lengths == ((2 * n,), (2 * n,)) and reads > 0, (n, id(cu) == dead)
    assert len(packing._KEPT) <= KEPT_PACKINGS


def test_inference_tensors_are_read_every_time():
    with torch.inference_mode():
        cu = torch.tensor([0, 4], dtype=torch.int32)
    assert _reads(cu, cu, cu, cu, 1, "zigzag")[1] > 0
    assert _reads(cu, cu, cu, cu, 1, "zigzag")[1] > 0


def test_forget_packings_reads_a_buffer_refilled_behind_torchs_back():
    """A write torch does not count (through ``.data``) leaves the version as it was: the kept
    packing would be stale, and forget_packings() makes the next call read the new one."""
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert packing_lengths(cu, cu, cu, cu, 1, "zigzag") == ((4, 4), (4, 4))
    cu.data[2] = 12  # no version bump
    assert packing_lengths(cu, cu, cu, cu, 1, "zigzag") == ((4, 4), (4, 4))  # kept, stale
    packing.forget_packings()
    assert packing_lengths(cu, cu, cu, cu, 1, "zigzag") == ((4, 8), (4, 8))
