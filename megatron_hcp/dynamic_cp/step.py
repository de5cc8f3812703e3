"""One dynamic-CP training step, the same for every client (the project's trainer and
Megatron-Bridge's loop): the global batch goes through the scheduler
(:meth:`~.runtime.DynamicCPDataPath.step`), this rank's packed micro-batches move to its device,
and megatron's forward-backward schedule runs over them with the arguments they need.

Each packed micro-batch carries its own CP group in ``packed_seq_params`` (``cp_group``,
``local_cp_size``, and the HCP level groups), which is how the attention binds the group the
plan chose for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sharding import MicroBatch
from .runtime import DynamicCPDataPath
from .scheduler import Plan

__all__ = ["DynamicStep", "PlannedMicroBatches", "plan_step", "schedule_arguments"]


class PlannedMicroBatches(Iterator):
    """This rank's packed micro-batches of one step, in order, for megatron's forward step
    (a type of its own, so a client's batch function can recognise them)."""

    def __init__(self, micro_batches: Sequence[MicroBatch]):
        self._items = iter(micro_batches)

    def __next__(self) -> MicroBatch:
        return next(self._items)


def schedule_arguments(micro_batches: Sequence[MicroBatch], chunks: int = 1) -> dict[str, Any]:
    """What megatron's forward-backward function needs for packed micro-batches: one iterator
    per model chunk (virtual pipeline stages read the same micro-batches), their count, and the
    longest one as the sequence length (the pipeline's shape; one packed row each)."""
    longest = max(int(mb.tokens.shape[1]) for mb in micro_batches)
    return {
        "data_iterator": ([PlannedMicroBatches(micro_batches) for _ in range(chunks)]
                          if chunks > 1 else PlannedMicroBatches(micro_batches)),
        "num_microbatches": len(micro_batches),
        "seq_length": longest,
        "micro_batch_size": 1,
    }


@dataclass(frozen=True)
class DynamicStep:
    """A global batch's dynamic-CP plan and this rank's micro-batches, on its device."""

    plan: Plan
    micro_batches: list[MicroBatch]


def plan_step(path: DynamicCPDataPath, ids: Sequence[int], load: Callable[[int], torch.Tensor],
              device: torch.device) -> DynamicStep:
    """Schedule the samples ``ids`` this rank's DP replica loaded (``load(i)``: an int64
    ``[3, L]`` sample) over the dynamic CP groups and move this rank's micro-batches to
    ``device``."""
    plan, micro = path.step(ids, load)
    return DynamicStep(plan, [mb.to(device) for mb in micro])
