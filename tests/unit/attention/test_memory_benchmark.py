"""The memory benchmark's verdicts (benchmarks/attention_memory.py): which baseline each
target reads. Single process: the rows are built from given step counts."""

from __future__ import annotations

from benchmarks.attention_memory import summarize, verdict
from megatron_hcp.attention.reference.memory import StepMemory
from megatron_hcp.attention.reference.memory_proxy import MemoryCase, floor_bytes


def _step(kept: int, peak: int) -> StepMemory:
    return StepMemory(kept=kept, peak=peak, after=0)


def test_an_a2a_with_kv_replicas_is_judged_against_its_floor():
    """An a2a wider than the KV heads (CP 8 over 2 KV heads) prints its peak over the plain
    GQA call and over the flash call on the replicated K/V (``rep``); its a2a target (1.5x)
    reads ``rep``: 2.0x the GQA call is within target at 1.18x of its floor, and missed at
    1.67x of it."""
    case = MemoryCase("a2a bshd gqa", "a2a", 8, kv_heads=2)
    assert case.kv_reps == 4
    floor = sum(floor_bytes(case).values())
    cp, flash = _step(floor, 200), _step(floor // 2, 100)
    row = summarize(case, [(cp, flash, _step(floor, 170))])
    assert row["peak"] == 2.0 and abs(row["rep"] - 200 / 170) < 1e-12
    assert row["kept_over_floor"] == 1.0 and verdict(row) == "ok"
    row = summarize(case, [(cp, flash, _step(floor, 120))])
    assert verdict(row) == "peak"


def test_without_replicas_the_peak_reads_the_flash_call():
    """Where no KV head is replicated (a2a over as many KV heads as ranks, or no a2a) there is
    no ``rep``: the peak target reads the ratio to the flash call on the rank's tokens."""
    case = MemoryCase("a2a bshd mha", "a2a", 8)
    assert case.kv_reps == 1
    floor = sum(floor_bytes(case).values())
    row = summarize(case, [(_step(floor, 160), _step(floor, 100), None)])
    assert "rep" not in row and verdict(row) == "peak"
    row = summarize(case, [(_step(floor, 140), _step(floor, 100), None)])
    assert verdict(row) == "ok"
    over = summarize(case, [(_step(floor + floor // 10, 140), _step(floor, 100), None)])
    assert verdict(over) == "kept"
