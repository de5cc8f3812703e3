"""Gloo groups of a rank share one transport device: one loop thread per rank instead of one per
group, with the same collectives and results."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from megatron_hcp.harness.gloo_device import _devices, gloo_device_shared
from megatron_hcp.harness.local_world import LocalWorld

GROUPS = 6


def gloo_loop_threads() -> int:
    """This process's gloo transport loop threads (gloo names them ``gloo_tcp_loop``)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as fh:
                count += fh.read().strip() == "gloo_tcp_loop"
        except OSError:  # a thread that ended meanwhile
            continue
    return count


def groups_and_their_threads() -> tuple[bool, int, list[float], bool]:
    """(device shared, loop threads, one all-reduce per group, gloo backends recognised)."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]) for _ in range(GROUPS)]
    sums = []
    for i, group in enumerate(groups):
        t = torch.tensor([float(dist.get_rank() + i)])
        dist.all_reduce(t, group=group)
        sums.append(t.item())
    backend = groups[0]._get_backend(torch.device("cpu"))
    recognised = isinstance(backend, c10d.ProcessGroupGloo) and dist.get_backend(groups[0]) == \
        "gloo"
    threads = gloo_loop_threads()
    for group in groups:
        dist.destroy_process_group(group)
    return gloo_device_shared(), threads, sums, recognised


@pytest.mark.multirank
@pytest.mark.parametrize("shared", [True, False])
def test_the_groups_of_a_rank_share_one_gloo_device(shared):
    with LocalWorld(2, share_gloo_device=shared) as world:
        results = world.run(groups_and_their_threads)
    for flag, threads, sums, recognised in results:
        assert flag is shared
        # the world group and GROUPS more: one device in all, or one each (torch's default)
        assert threads == (1 if shared else GROUPS + 1), threads
        assert sums == [1.0 + 2 * i for i in range(GROUPS)]
        assert recognised


def test_devices_follow_gloo_socket_ifname(monkeypatch):
    gloo = torch.distributed.ProcessGroupGloo
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert len(_devices(gloo, None)) == 2  # one per listed interface, as torch makes them
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert len(_devices(gloo, None)) == 1
    assert len(_devices(gloo, "127.0.0.1")) == 1
