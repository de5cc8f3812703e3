"""The dynamic-CP scheduler's efficiency over caps, model sizes and length mixes (issue
"Dynamic hierarchical CP", robustness), against the lower bounds of ``dynamic_cp.bounds``.

A reduced grid of ``benchmarks/dynamic_cp.py --sweep`` (the full table is in RESULTS.md), including
the cases that missed before 7afb309 (2026-11-24): megatron's DCP lengths with an 8B-sized model at
N=64 (measured 0.959 by an independent check) and hidden 512 at N=256 (0.953)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hcp.dynamic_cp.bounds import free_split_bound, min_group_bound
from megatron_hcp.dynamic_cp.mixes import MIXES, length_mix
from megatron_hcp.dynamic_cp.scheduler import schedule
from megatron_hcp.dynamic_cp.workload import GPTWorkload

MODELS = {
    "h512": GPTWorkload(num_layers=12, hidden_size=512, num_attention_heads=8),
    "8B": GPTWorkload(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                      num_attention_heads=32, num_query_groups=8, gated_mlp=True),
    "h4096": GPTWorkload(num_layers=32, hidden_size=4096, num_attention_heads=32),
    "70B": GPTWorkload(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                       num_attention_heads=64, num_query_groups=8, gated_mlp=True),
}
TARGET = {64: 0.97, 256: 0.96}


@pytest.mark.parametrize("model, n, cap, mix", [
    ("8B", 64, 512, "dcp"), ("h4096", 64, 16384, "dcp"), ("h512", 256, 512, "dcp"),
    ("70B", 256, 1024, "scaled"), ("h512", 64, 1024, "scaled"), ("8B", 256, 2048, "scaled"),
    ("8B", 64, 4096, "long_tail"), ("70B", 64, 8192, "bimodal"), ("h512", 256, 16384, "bimodal"),
])
def test_efficiency_targets_hold_across_caps_models_and_mixes(model, n, cap, mix):
    workload = MODELS[model]
    lengths = length_mix(mix, np.random.default_rng(7), 2048, n, cap)
    plan = schedule(lengths, n, cap, workload=workload)
    bound = free_split_bound(lengths, n, workload)
    assert plan.summary["ideal"] == pytest.approx(bound, rel=1e-12)
    efficiency = bound / plan.summary["makespan"]
    assert efficiency >= TARGET[n], (model, n, cap, mix, efficiency)
    assert plan.summary["peak_tokens_per_rank"] <= cap


@pytest.mark.parametrize("seed", range(6))
def test_no_plan_beats_the_lower_bounds(seed):
    """Random small batches: every plan's makespan is at least total work / N; the
    smallest-group bound is at least that and at least its heaviest sequence."""
    rng = np.random.default_rng(seed)
    n, cap = int(rng.choice([4, 8, 16])), int(rng.choice([64, 256]))
    workload = MODELS[str(rng.choice(list(MODELS)))]
    lengths = [min(x, n * cap) for x in length_mix(  # at most what N ranks can hold
        str(rng.choice(MIXES)), rng, int(rng.integers(1, 80)), n, cap)]
    plan = schedule(lengths, n, cap, workload=workload)
    free = free_split_bound(lengths, n, workload)
    assert plan.summary["makespan"] >= free * (1 - 1e-12)
    nosplit = min_group_bound(lengths, n, cap, workload)
    heaviest = max(workload.cost(x, 1) for x in lengths) / n
    assert nosplit >= free and nosplit >= heaviest


def test_bounds_are_tight_where_the_optimum_is_known():
    """N equal sequences that each fill one rank: one micro-batch, one per rank, is optimal
    and reaches the bound; one long sequence that needs 4 of 8 ranks bounds the no-split
    makespan by its own cost over 4 ranks."""
    workload = MODELS["8B"]
    plan = schedule([256] * 8, 8, 256, workload=workload)
    assert plan.summary["makespan"] == pytest.approx(free_split_bound([256] * 8, 8, workload))
    lengths = [1000, 10, 10]
    assert min_group_bound(lengths, 8, 256, workload) == pytest.approx(
        workload.cost(1000, 1) / 4)
    assert free_split_bound(lengths, 8, workload) < workload.cost(1000, 1) / 4
