"""Ranks as threads (megatron_hcp.harness.threaded_world) on CPU tensors: the harness the
one-GPU suite (tests/gpu) runs on CUDA tensors, here exercised with every CP attention oracle
case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.attention.reference.kernel_support import CPU_FLASH, MATH
from megatron_hcp.harness.local_world import RankError
from megatron_hcp.harness.threaded_world import ThreadedWorld, ThreadedWorldError
from tests.gpu.test_one_gpu_attention import kernels_and_errors
from tests.unit.attention.test_cp_attention import (
    COMMS,
    WORLD,
    all_oracle_cases,
    failures_of,
    run_cases,
    runnable_in,
)


@pytest.fixture(scope="module")
def threads():
    with ThreadedWorld(WORLD, device="cpu") as world:
        yield world


@pytest.mark.parametrize("name", sorted(all_oracle_cases()))
def test_oracle_cases_on_rank_threads(threads, name):
    """Every CP attention oracle case of test_cp_attention (each comm type x format x
    causal/full, MLA head dims, windows, softmax offsets, bias), forward and backward, with the
    ranks as threads of this process and the same tolerances."""
    cases = all_oracle_cases()[name]
    assert not (bad := failures_of(cases, threads.run(run_cases, cases, "cpu"))), bad[:8]


def out_of_order_waits():
    """Rank 0 sends A then B to rank 1 on one (group, tag); rank 1 posts two receives and
    waits for the second first: it must hold B (matched when posted, as gloo and NCCL do)."""
    rank = dist.get_rank()
    if rank == 0:
        works = [dist.isend(torch.tensor([1.0]), 1), dist.isend(torch.tensor([2.0]), 1)]
        for work in works:
            work.wait()
        return None
    if rank == 1:
        first, second = torch.zeros(1), torch.zeros(1)
        works = [dist.irecv(first, 0), dist.irecv(second, 0)]
        works[1].wait()
        got_second = second.item()
        works[0].wait()
        return first.item(), got_second
    return None


def test_point_to_point_matches_messages_in_posting_order(threads):
    assert threads.run(out_of_order_waits)[1] == (1.0, 2.0)


def fail_on_rank_two():
    if dist.get_rank() == 2:
        raise ValueError("rank two fails")
    dist.barrier()  # the others wait for rank 2, which never comes
    return dist.get_rank()


def test_failing_rank_releases_the_others_and_the_world_restarts(threads):
    with pytest.raises(RankError, match="rank two fails") as info:
        threads.run(fail_on_rank_two)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    assert info.value.errors[2][0] == "ValueError"
    assert {info.value.errors[r][0] for r in (0, 1, 3)} == {"Released"}
    assert threads.run(dist.get_rank) == [0, 1, 2, 3]


@pytest.mark.multirank
def test_one_threaded_world_per_process(threads):
    threads.start()
    with pytest.raises(ThreadedWorldError, match="already running"):
        ThreadedWorld(2).start()


def test_close_restores_the_process_state(threads):
    threads.close()
    before = dist.distributed_c10d._world
    threads.start()
    assert dist.distributed_c10d._world is not before  # per-thread worlds while it runs
    assert threads.run(dist.get_world_size) == [WORLD] * WORLD
    threads.close()
    assert dist.distributed_c10d._world is before
    assert not dist.is_initialized()
    assert torch.autograd.is_multithreading_enabled()
    assert threads.run(dist.get_rank) == list(range(WORLD))  # and starts again


@pytest.mark.multirank
def test_bad_arguments_are_named():
    missing = torch.cuda.device_count()  # no such GPU: none on CPU machines, one past the last
    with pytest.raises(ThreadedWorldError, match=f"device=cuda:{missing}"):
        ThreadedWorld(2, device=f"cuda:{missing}").start()
    with pytest.raises(ThreadedWorldError, match="world_size=0"):
        ThreadedWorld(0)
    with pytest.raises(ThreadedWorldError, match="device='mps'"):
        ThreadedWorld(2, device="mps")


@pytest.mark.multirank
def test_oracle_cases_of_a_two_rank_world(threads):
    """The subset a 2-rank world runs (the 2-GPU NCCL suite's cases), on 2 rank threads."""
    threads.close()  # one threaded world per process
    named = all_oracle_cases()
    cases = [c for name in sorted(named) for c in runnable_in(named[name], 2)]
    assert cases and {c[4] for c in cases} == {2}
    assert not runnable_in(named["offset/p2p"], 2)  # learnable offsets: CP 4 = the world only
    with ThreadedWorld(2) as pair:
        assert not (bad := failures_of(cases, pair.run(run_cases, cases, "cpu"))), bad[:8]


@pytest.mark.parametrize("comm", COMMS)
def test_the_gpu_suites_kernel_check_on_cpu(threads, comm):
    """tests/gpu's fused-kernel check, run here on CPU tensors: the dense blocks take the CPU
    flash kernel (with its mask under a window) and CP attention is as accurate as one SDPA call
    (fp32)."""
    results = threads.run(kernels_and_errors, comm, torch.float32, "cpu")
    assert {k for kernels, _, _ in results for (k, _why) in kernels} == {CPU_FLASH}
    assert max(e for _, e, _ in results) <= 2 * max(e for _, _, e in results) + 1e-3
    # its MLA variant (d_v 32): the CPU's math path, as accurate
    mla = threads.run(kernels_and_errors, comm, torch.float32, "cpu", 32)
    assert {k for kernels, _, _ in mla for (k, _why) in kernels} == {MATH}
    assert max(e for _, e, _ in mla) <= 2 * max(e for _, _, e in mla) + 1e-3
    # its sliding-window variant: masked blocks, the CPU flash kernel with the mask
    band = threads.run(kernels_and_errors, comm, torch.float32, "cpu", 64, (40, 0))
    assert {k for kernels, _, _ in band for (k, _why) in kernels} == {CPU_FLASH}
    assert max(e for _, e, _ in band) <= 2 * max(e for _, _, e in band) + 1e-3
