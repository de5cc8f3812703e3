"""Fit the efficiency constants of :mod:`megatron_hcp.planner.gpus` to the ``fit: true`` runs.

Loss: the sum over those runs of ``log(projected / measured)^2`` (projections of the published
layouts). A source kept out of the summary (its hardware is not a preset: torchtitan's 500 W
H100) contributes only through ratios between its own runs: its runs' mean log error is
subtracted (the unknown clock of its GPUs is one factor common to them), so e.g. its BF16 and
FP8 runs of one model on one machine pin the BF16 efficiency relative to the FP8 one.
Coordinate descent, each constant by golden-section search in [0.05, 0.95]; a
constant no fit run depends on keeps its value (Blackwell BF16 GEMMs take Hopper's, see
:mod:`megatron_hcp.planner.gpus`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..gpus import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, GPUS
from .compare import compare_run
from .data import PublishedRun

__all__ = ["FitResult", "fit_efficiencies", "fit_loss"]

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass
class FitResult:
    gemm: dict[tuple[str, str], float]
    attention: dict[str, float]
    loss: float
    runs: list[str]


def fit_loss(runs: Sequence[PublishedRun], gemm: dict, attention: dict) -> float:
    logs: dict[tuple[str, bool], list[float]] = {}
    for r in runs:
        c = compare_run(r, with_best=False, gemm_efficiency=gemm, attention_efficiency=attention)
        if c.projected is None:
            raise ValueError(f"fit run {r.id} has no projection ({c.note})")
        logs.setdefault((r.source, r.in_summary), []).append(math.log(c.projected / c.measured))
    total = 0.0
    for (_, absolute), values in logs.items():
        offset = 0.0 if absolute else sum(values) / len(values)
        total += sum((v - offset) ** 2 for v in values)
    return total


def _golden(f, lo: float, hi: float, tol: float = 1e-4) -> float:
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_efficiencies(runs: Sequence[PublishedRun], sweeps: int = 4) -> FitResult:
    """Fit on ``runs`` (use the ``fit`` ones); returns the constants and the final loss."""
    fit_runs = [r for r in runs if r.fit]
    if not fit_runs:
        raise ValueError("no run is marked fit: true")
    gemm, attention = dict(GEMM_EFFICIENCY), dict(ATTENTION_EFFICIENCY)
    archs = {GPUS[r.gpu].arch for r in fit_runs}
    keys = sorted({(GPUS[r.gpu].arch, r.precision) for r in fit_runs})
    for _ in range(sweeps):
        for key in keys:
            def loss_g(x, key=key):
                return fit_loss(fit_runs, {**gemm, key: x}, attention)
            gemm[key] = _golden(loss_g, 0.05, 0.95)
        for arch in sorted(archs):
            def loss_a(x, arch=arch):
                return fit_loss(fit_runs, gemm, {**attention, arch: x})
            attention[arch] = _golden(loss_a, 0.05, 0.95)
    if ("blackwell", "bf16") not in keys and ("hopper", "bf16") in keys:
        gemm[("blackwell", "bf16")] = gemm[("hopper", "bf16")]
    return FitResult(gemm, attention, fit_loss(fit_runs, gemm, attention),
                     [r.id for r in fit_runs])
