"""CP attention's host-planned paths keep every tensor on its data's device: packed (thd)
sequences on the ring and the all-gather, their blocks in row chunks that take only the columns
their rows reach (``masks.Reach``, planned on the host) and their backward reading the output in
the model's order (``reorder.RowsInOrder``: views, gathered parts, the whole), and a window's
chunks, run on an emulated GPU (``harness.virtual_cuda``) without a device mix, forward and
backward, their gradients on the GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.harness.local_world import LocalWorld

pytestmark = [pytest.mark.multirank, pytest.mark.torch_only]

WORLD = 2


@pytest.fixture(scope="module")
def world():
    with LocalWorld(WORLD) as w:  # the emulation changes its processes for good: their own
        yield w


def chunked_steps_on_a_gpu() -> dict:
    """Each case's forward and backward on this rank's emulated GPU, its masked and math
    blocks whole and in row chunks of a few rows (chunks across sequences: gathered rows;
    within one: views): the device mixes found and the gradients' devices."""
    import torch.distributed as dist

    from megatron_hcp.attention.reference import context_parallel_attention, kernels
    from megatron_hcp.harness.virtual_cuda import virtual_cuda
    from megatron_hcp.parallel_state.groups import bare_cp_groups
    from megatron_hcp.sharding import get_local_chunk

    rank = dist.get_rank()
    group, _ = bare_cp_groups(WORLD, None)
    saved = kernels.CHUNK_ELEMENTS, kernels.MASK_ELEMENTS, kernels.MASK_SHARE
    devices = {}
    try:
        with virtual_cuda(rank) as audit:
            torch.cuda.set_device(rank)
            cu = torch.tensor([0, 32, 48, 96], dtype=torch.int32, device="cuda")
            for comm, window, chunks in (("p2p", None, False), ("p2p", None, True),
                                         ("all_gather", None, True), ("p2p", (8, 0), True)):
                if chunks:  # rows of 256 mask elements: 5 to 10 rows a chunk
                    kernels.CHUNK_ELEMENTS, kernels.MASK_ELEMENTS, kernels.MASK_SHARE = (
                        256, 256, 2**62)
                gen = torch.Generator().manual_seed(0)
                full = [torch.randn(96, 2, 8, generator=gen).cuda() for _ in range(4)]
                q, k, v, dout = (get_local_chunk(x, WORLD, rank, "thd", cu).contiguous()
                                 for x in full)
                leaves = [x.requires_grad_() for x in (q, k, v)]
                out = context_parallel_attention(
                    *leaves, cp_comm_type=comm, cp_group=group, qkv_format="thd",
                    cu_seqlens_q=cu, cu_seqlens_q_padded=cu, window_size=window)
                out.backward(dout)
                devices[f"{comm} {window} {chunks}"] = sorted(
                    {str(x.grad.device) for x in leaves})
    finally:
        kernels.CHUNK_ELEMENTS, kernels.MASK_ELEMENTS, kernels.MASK_SHARE = saved
    return {"mixes": [m.line() for m in audit.mixes], "devices": devices}


def test_chunked_packed_attention_stays_on_its_device(world):
    for rank, got in enumerate(world.run(chunked_steps_on_a_gpu)):
        assert got["mixes"] == [], (rank, got["mixes"])
        assert len(got["devices"]) == 4
        assert all(d == [f"cuda:{rank}"] for d in got["devices"].values()), (rank, got)
