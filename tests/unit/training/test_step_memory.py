"""counted_schedules: the bytes a schedule holds when its first backward starts and its peak,
counted by LiveBytes around the schedule a loop gets; everything restored after."""

from __future__ import annotations

import types

import torch

from megatron_hcp.training.step_memory import counted_schedules


def test_a_schedule_is_counted_at_its_first_backward_and_at_its_peak(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    monkeypatch.setattr(schedules, "backward_step", lambda kept: kept.sum())

    def schedule():
        kept = torch.ones(1000)            # 4000 bytes held from "forward" to "backward"
        schedules.backward_step(kept)       # the first backward starts here
        scratch = torch.ones(3000)          # a transient of the backward: the peak
        del scratch
        schedules.backward_step(kept)       # a later backward does not move the mark
        return None

    owner = types.SimpleNamespace(get_forward_backward_func=lambda: schedule)
    original = owner.get_forward_backward_func
    marked = schedules.backward_step
    with counted_schedules(owner) as seen:
        owner.get_forward_backward_func()()
        first = dict(seen)
        owner.get_forward_backward_func()()  # the last run's figures
    assert first["activations"] == 4000
    assert first["peak"] >= 4000 + 12000
    assert seen == first
    assert owner.get_forward_backward_func is original and schedules.backward_step is marked
