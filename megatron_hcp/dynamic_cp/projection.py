"""Projected step time of a plan: compute at a FLOP rate plus the exposed CP ring traffic.

The FLOPs model of :mod:`.workload` makes splitting a sequence over more ranks free, so under
it alone static CP (every sequence on one fixed CP size) is perfectly balanced. What static CP
really pays for is communication: a sequence on ``c`` ranks runs ``c - 1`` ring steps per layer
forward and backward, each sending one K/V chunk (backward: K/V plus dK/dV), overlapped with
that step's attention block. This module projects that cost so plans can be compared on it.

Per layer, per ring step of a sequence of length ``L`` on ``c`` ranks (chunk ``L / c``):

* forward: send ``2 * chunk * kv_hidden`` elements, overlapped with ``1 / c`` of the rank's
  forward attention FLOPs; exposed = ``max(0, latency + bytes / bandwidth - attention time)``;
* backward: twice the bytes, overlapped with the backward attention (2x forward).

The hardware numbers are assumptions (defaults: an H100-class GPU, 400 TFLOP/s achieved,
100 GB/s and 10 us per ring step); the benchmark prints results for several of them. This is a
projection, not a measurement: no GPU was available to calibrate it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .workload import GPTWorkload

__all__ = ["Hardware", "group_seconds", "plan_seconds", "projected_seconds", "static_cp_seconds"]


@dataclass(frozen=True)
class Hardware:
    """Assumed accelerator and CP-link numbers for a projection."""

    flops_per_second: float = 400e12
    bytes_per_second: float = 100e9
    latency_seconds: float = 10e-6
    bytes_per_element: int = 2


def projected_seconds(workload: GPTWorkload, length: int, group_size: int,
                      hw: Hardware) -> float:
    """Seconds one rank spends on ``length`` split over ``group_size`` ranks (fwd + bwd)."""
    if workload.mode != "flops":
        raise ValueError("projection needs workload.mode='flops' (it converts FLOPs to seconds)")
    compute = workload.cost(length, group_size) / hw.flops_per_second
    c = group_size
    if c == 1:
        return compute
    head = workload.hidden_size // workload.num_attention_heads
    kv_hidden = (workload.num_query_groups or workload.num_attention_heads) * head
    chunk_bytes = 2 * (length / c) * kv_hidden * hw.bytes_per_element
    # forward attention FLOPs of this rank in one layer, spread over the c ring steps
    fwd_step = workload.attention_flops(length) / (3 * workload.num_layers) / c / c
    fwd_exposed = max(0.0, hw.latency_seconds + chunk_bytes / hw.bytes_per_second
                      - fwd_step / hw.flops_per_second)
    bwd_exposed = max(0.0, hw.latency_seconds + 2 * chunk_bytes / hw.bytes_per_second
                      - 2 * fwd_step / hw.flops_per_second)
    return compute + workload.num_layers * (c - 1) * (fwd_exposed + bwd_exposed)


def group_seconds(workload: GPTWorkload, lengths: Sequence[int], samples: Iterable[int],
                  group_size: int, hw: Hardware) -> float:
    """Seconds each rank of a CP group spends on ``samples`` (all split over the group)."""
    return sum(projected_seconds(workload, lengths[s], group_size, hw) for s in samples)


def plan_seconds(plan, lengths: Sequence[int], workload: GPTWorkload, hw: Hardware) -> float:
    """Projected step of a dynamic-CP plan: sum over micro-batches of the slowest rank."""
    return sum(max((group_seconds(workload, lengths, g.samples, len(g.ranks), hw)
                    for g in mb.groups), default=0.0) for mb in plan.micro_batches)


def static_cp_seconds(replicas: Sequence[Sequence[int]], lengths: Sequence[int], cp: int,
                      workload: GPTWorkload, hw: Hardware) -> float:
    """Projected step of static CP: DP replicas only meet at the step end (slowest replica)."""
    return max(group_seconds(workload, lengths, samples, cp, hw) for samples in replicas)
