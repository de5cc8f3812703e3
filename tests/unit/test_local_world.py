"""A pooled world that stops answering says so, with the silent ranks' stacks."""

from __future__ import annotations

import time

import pytest

from megatron_hcp.local_world import LocalWorld, RankError


def stall_on_rank_one() -> int:
    """Rank 1 never answers in time; rank 0 does."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)
    return dist.get_rank()


def test_timeout_names_silent_ranks_and_prints_their_stacks(capfd):
    with LocalWorld(2, timeout_s=1.0) as world:
        with pytest.raises(RankError) as err:
            world.run(stall_on_rank_one)
    assert err.value.errors == {1: ("Timeout", "no answer in 31s (its stacks: stderr)")}
    stacks = capfd.readouterr().err
    assert "stall_on_rank_one" in stacks, stacks[-2000:]
