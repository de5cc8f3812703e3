"""A pooled world that stops answering names the silent ranks and shows their stacks."""

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


def test_timeout_names_silent_ranks_with_their_stacks():
    with LocalWorld(2, timeout_s=1.0) as world:
        with pytest.raises(RankError) as err:
            world.run(stall_on_rank_one)
    assert list(err.value.errors) == [1], err.value.errors
    kind, text = err.value.errors[1]
    assert kind == "Timeout" and text.startswith("no answer in 31s; its stacks:"), text
    assert "in stall_on_rank_one" in text, text  # the line rank 1 hangs on
