"""A whole training step's memory per rank, counted around megatron's pipeline schedule.

:func:`counted_schedules` wraps the schedule getter a training loop calls
(``megatron.core.pipeline_parallel.get_forward_backward_func`` for the project's trainer,
``megatron.bridge.training.train.get_forward_backward_func`` for Bridge's loop) so that every
schedule it returns runs under :class:`~megatron_hcp.attention.reference.memory.LiveBytes`:
the bytes held when its first backward starts (the activations, kept from forward to backward;
weights, gradient buffers and optimizer states exist before the schedule and are not counted)
and its peak, of the last schedule run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["counted_schedules"]


@contextlib.contextmanager
def counted_schedules(owner: Any, name: str = "get_forward_backward_func"
                      ) -> Iterator[dict[str, int]]:
    """While open, ``owner.<name>``'s schedules are counted; yields the dict that holds the last
    one's ``activations`` and ``peak`` (bytes). ``owner.<name>`` and megatron's
    ``schedules.backward_step`` are restored on exit."""
    from megatron.core.pipeline_parallel import schedules

    from ..attention.reference.memory import LiveBytes

    seen: dict[str, int] = {}
    running: list[LiveBytes] = []  # the counter of the schedule running now, if any
    get_schedule, backward_step = getattr(owner, name), schedules.backward_step

    def marked_backward(*args, **kwargs):
        if running and "activations" not in seen:
            seen["activations"] = running[0].current
        return backward_step(*args, **kwargs)

    def counted_schedule(*args, **kwargs):
        schedule = get_schedule(*args, **kwargs)

        def run(*run_args, **run_kwargs):
            seen.clear()
            with LiveBytes() as mem:
                running[:] = [mem]
                try:
                    result = schedule(*run_args, **run_kwargs)
                finally:
                    running.clear()
            seen["peak"] = mem.peak
            return result
        return run

    setattr(owner, name, counted_schedule)
    schedules.backward_step = marked_backward
    try:
        yield seen
    finally:
        setattr(owner, name, get_schedule)
        schedules.backward_step = backward_step
