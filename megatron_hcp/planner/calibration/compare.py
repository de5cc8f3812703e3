"""The planner's projection of each published run, next to the measurement, and the summary.

For a run with a published layout: the projection of exactly that layout (precision, recompute
and GPU preset of the run), and - unless ``with_best=False`` - the planner's own ranking on the
same cluster and batch: the measured layout's rank (1 + the fitting layouts projected faster)
and its gap to the planner's best. For a run whose layout is not published (the long-sequence
tables' "without CP" columns): the planner's best layout with the same CP size stands in.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import plan
from ..estimate import Estimate, estimate
from ..gpus import cluster_for
from ..inputs import Batch, Options
from .data import PublishedRun

__all__ = ["Comparison", "PairGain", "Summary", "compare_all", "compare_run", "pair_gains",
           "run_cluster", "run_options", "summarize"]


def run_cluster(run: PublishedRun, gemm_efficiency: dict | None = None,
                attention_efficiency: dict | None = None):
    extra: dict = {}
    if run.gpu_memory_gb:
        extra["memory_bytes"] = run.gpu_memory_gb * 1e9
    return cluster_for(run.gpu, run.precision, run.gpus // run.gpus_per_node,
                       run.gpus_per_node, gemm_efficiency=gemm_efficiency,
                       attention_efficiency=attention_efficiency, **extra)


def run_options(run: PublishedRun, ranking: bool = False) -> Options:
    """The run's options; for the planner's own ranking (``ranking``) an unreported recompute
    is the planner's default ``auto``."""
    recompute = "auto" if ranking and run.recompute is None else run.recompute_mode
    return Options(recompute=recompute, precision=run.precision,
                   fsdp=run.data_parallel == "fsdp", tp_comm_overlap=run.tp_comm_overlap,
                   grad_reduce_in_bf16=run.grad_reduce_in_bf16)


@dataclass
class Comparison:
    run: PublishedRun
    projected: float | None  # tokens/s/GPU
    estimate: Estimate | None  # of the published layout, or the stand-in
    best: Estimate | None = None  # the planner's winner (when with_best)
    rank: int | None = None
    gap: float | None = None  # measured layout's step / best step - 1
    note: str = ""

    @property
    def measured(self) -> float:
        return self.run.measured

    @property
    def error(self) -> float | None:
        """projected / measured - 1."""
        return None if self.projected is None else self.projected / self.measured - 1


def _stand_in(ranked: Sequence[Estimate], cp: int) -> Estimate | None:
    same = [e for e in ranked if not e.layout.dynamic and e.layout.cp == cp]
    fitting = [e for e in same if e.fits]
    return (fitting or same or [None])[0]


def compare_run(run: PublishedRun, with_best: bool = True,
                gemm_efficiency: dict | None = None,
                attention_efficiency: dict | None = None) -> Comparison:
    """Projection (and, with ``with_best``, the planner's ranking) of one published run."""
    cluster = run_cluster(run, gemm_efficiency, attention_efficiency)
    batch = Batch.fixed_length(run.seq_length, run.global_batch)
    options = run_options(run)
    if run.layout is not None:
        exact = estimate(run.model, batch, cluster, options, run.layout)
        if exact is None:
            return Comparison(run, None, None, note="CPConfig refuses the published layout")
        result = Comparison(run, exact.tokens_per_second_per_gpu, exact)
        if not exact.fits:
            result.note = "the model says it does not fit"
        if with_best:
            ranked = plan(run.model, batch, cluster, run_options(run, True)).ranked
            fitting = [e for e in ranked if e.fits]
            if not fitting:
                fitting = ranked
                result.note = "; ".join(x for x in (result.note, "no layout fits the memory "
                                                    "model with the reported recompute") if x)
            result.best = fitting[0]
            result.rank = 1 + sum(e.step_seconds < exact.step_seconds for e in fitting)
            result.gap = exact.step_seconds / result.best.step_seconds - 1
        return result
    ranked = plan(run.model, batch, cluster, run_options(run, True)).ranked
    stand_in = _stand_in(ranked, 1)
    if stand_in is None:
        return Comparison(run, None, None, note="no layout without CP")
    return Comparison(run, stand_in.tokens_per_second_per_gpu, stand_in, best=ranked[0],
                      note=f"layout not published: the planner's best without CP, "
                           f"{stand_in.layout.label}")


def compare_all(runs: Sequence[PublishedRun], with_best: bool = True,
                gemm_efficiency: dict | None = None,
                attention_efficiency: dict | None = None) -> list[Comparison]:
    """:func:`compare_run` of every run; without ``with_best`` runs with no published layout
    are skipped (they need the planner's ranking)."""
    return [compare_run(r, with_best, gemm_efficiency, attention_efficiency) for r in runs
            if with_best or r.layout is not None]


@dataclass
class PairGain:
    key: str
    measured: float  # tokens/s/GPU with CP / without CP
    projected: float
    with_cp: Comparison
    without_cp: Comparison


def pair_gains(comparisons: Sequence[Comparison]) -> list[PairGain]:
    """Measured and projected gain of CP over no CP for every ``pair`` with both rows."""
    groups: dict[str, dict[str, Comparison]] = {}
    for c in comparisons:
        if c.run.pair and c.projected:
            kind = "cp" if c.run.layout is not None and c.run.layout.cp > 1 else "nocp"
            groups.setdefault(c.run.pair, {})[kind] = c
    out = []
    for key, g in groups.items():
        if "cp" in g and "nocp" in g:
            cp, no = g["cp"], g["nocp"]
            assert cp.projected and no.projected
            out.append(PairGain(key, cp.measured / no.measured, cp.projected / no.projected,
                                cp, no))
    return out


@dataclass
class Summary:
    runs: int  # runs with a published layout and a projection
    median_error: float  # median |projected / measured - 1|
    worst_error: float
    worst_id: str
    within_20: int  # runs with |error| <= 20 %
    ranked: int = 0  # runs with a planner ranking
    within_5_of_best: int = 0  # ... whose measured layout is within 5 % of the planner's best
    worst_gap: float = 0.0
    worst_gap_id: str = ""
    held_out: dict = field(default_factory=dict)  # the same error statistics, held-out rows

    def line(self) -> str:
        """One line for ``megatron-hcp plan``."""
        return (f"calibration: median |error| {100 * self.median_error:.0f} % over {self.runs} "
                f"published runs ({self.within_20} within 20 %), worst "
                f"{100 * self.worst_error:.0f} % ({self.worst_id}); see benchmarks/RESULTS.md")


def _errors(comparisons: Sequence[Comparison]) -> list[tuple[float, str]]:
    return [(abs(c.error), c.run.id) for c in comparisons
            if c.error is not None and c.run.layout is not None]


def summarize(comparisons: Sequence[Comparison]) -> Summary:
    """Error statistics over the runs with a published layout whose hardware is a preset
    (``in_summary``): all of them, and those held out of the fit."""
    comparisons = [c for c in comparisons if c.run.in_summary]
    errors = _errors(comparisons)
    if not errors:
        raise ValueError("no comparison with a published layout and a projection")
    worst = max(errors)
    s = Summary(len(errors), statistics.median(e for e, _ in errors), worst[0], worst[1],
                sum(e <= 0.20 for e, _ in errors))
    held = _errors([c for c in comparisons if not c.run.fit])
    if held:
        s.held_out = {"runs": len(held), "median_error": statistics.median(e for e, _ in held),
                      "worst_error": max(held)[0], "within_20": sum(e <= 0.20 for e, _ in held)}
    gaps = [(c.gap, c.run.id) for c in comparisons if c.gap is not None]
    if gaps:
        s.ranked = len(gaps)
        s.within_5_of_best = sum(g <= 0.05 for g, _ in gaps)
        s.worst_gap, s.worst_gap_id = max(gaps)
    return s
