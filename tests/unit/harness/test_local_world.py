"""A pooled world that stops answering names the silent ranks and shows their stacks."""

from __future__ import annotations

import time

import pytest

from megatron_hcp.harness.local_world import LocalWorld, RankError

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)


def stall_on_rank_one() -> int:
    """Rank 1 never answers in time; rank 0 does."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def test_timeout_names_silent_ranks_with_their_stacks():
    # a short grace past the ranks' own 1 s timeout (the default 30 s lets a rank's collective
    # timeout speak first); the ranks have joined before the stall (the first run waits)
    with LocalWorld(2, timeout_s=1.0, grace_s=3.0) as world:
        assert world.run(what_a_rank_sees, timeout_s=120) == [("", True, True)] * 2
        with pytest.raises(RankError) as err:
            world.run(stall_on_rank_one)
    assert list(err.value.errors) == [1], err.value.errors
    kind, text = err.value.errors[1]
    assert kind == "Timeout" and text.startswith("no answer in 4s; its stacks:"), text
    assert "in stall_on_rank_one" in text, text  # the line rank 1 hangs on


def what_a_rank_sees() -> tuple[str | None, bool, bool]:
    """The GPUs visible to this rank and whether it can start a process of its own."""
    import multiprocessing
    import os

    return (os.environ.get("CUDA_VISIBLE_DEVICES"),
            multiprocessing.current_process().daemon, multiprocessing.parent_process() is not None)


def test_gloo_ranks_see_no_gpu_and_may_start_processes_when_not_daemonic():
    """CPU ranks hide the GPUs (nothing in them - torch's own probes included - can initialize
    CUDA on a machine that has it); non-daemonic ranks may start processes (megatron's
    checkpoint writer does) and are closed at exit if their owner did not."""
    from megatron_hcp.harness.local_world import _OPEN

    with LocalWorld(1) as daemonic:
        assert daemonic.run(what_a_rank_sees)[0] == ("", True, True)
    with LocalWorld(1, daemon=False, env={"CUDA_VISIBLE_DEVICES": "3"}) as own:
        assert own.run(what_a_rank_sees)[0] == ("3", False, True)  # the caller's choice wins
        assert own in _OPEN
