"""The layout planner held against published measurements (``megatron_hcp/planner/calibration``).

For every run of ``published.yaml``: the measured tokens/s per GPU (as published, or derived from
the published TFLOP/s with the publisher's FLOPs convention), the planner's projection of that
exact layout and its error, the measured layout's rank among the planner's own layouts on the
same cluster and batch and its gap to the planner's best; for the long-sequence tables the
projected vs measured gain of CP over the best layout without CP; then the summary (median and
worst error, all runs and the runs held out of the fit). ``--fit`` refits the efficiency
constants of ``megatron_hcp/planner/gpus.py`` on the ``fit: true`` runs and prints them.

Run: ``flock /tmp/mhcp-heavy.lock .venv/bin/python benchmarks/plan_calibration.py`` (a few
minutes: the planner ranks every layout of the 16,384-GPU runs). ``--no-best`` skips the
rankings (seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.planner import Batch, gpus, plan  # noqa: E402
from megatron_hcp.planner.calibration import (  # noqa: E402
    compare_all,
    load_published,
    pair_gains,
    summarize,
)
from megatron_hcp.planner.calibration.compare import run_cluster, run_options  # noqa: E402
from megatron_hcp.planner.calibration.fit import fit_efficiencies  # noqa: E402
from megatron_hcp.planner.calibration.plot import plot_comparisons  # noqa: E402


def _layout(c) -> str:
    lay = c.run.layout
    if lay is None:
        return "(not published)"
    return lay.label


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-best", action="store_true", help="skip the planner's own rankings")
    ap.add_argument("--fit", action="store_true", help="refit the efficiency constants")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="projected vs measured tokens/s per GPU, every run (PNG)")
    args = ap.parse_args()
    runs = load_published()
    if args.fit:
        f = fit_efficiencies(runs)
        print(f"fit on {len(f.runs)} runs ({', '.join(f.runs)}); loss {f.loss:.4g}")
        for key, value in f.gemm.items():
            print(f"  GEMM_EFFICIENCY[{key}] = {value:.3f} (now {gpus.GEMM_EFFICIENCY[key]:.3f})")
        for key, value in f.attention.items():
            print(f"  ATTENTION_EFFICIENCY[{key!r}] = {value:.3f} "
                  f"(now {gpus.ATTENTION_EFFICIENCY[key]:.3f})")
        print()
    comparisons = compare_all(runs, with_best=not args.no_best)
    if args.plot:
        plot_comparisons(comparisons, args.plot)
    print("| run | model | seq | GPUs | GPU, precision | published layout | measured tok/s/GPU "
          "| projected | error | rank | gap to best | planner's best | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in comparisons:
        r = c.run
        flags = ("fit " if r.fit else "") + ("" if r.in_summary else "not in summary ")
        best = c.best.layout.label if c.best is not None else "-"
        if c.best is not None and c.best.recompute == "full":
            best += " (full recompute)"
        notes = "; ".join(x for x in (flags.strip(), c.note) if x)
        print(f"| {r.id} | {r.model_key} | {r.seq_length // 1024}K | {r.gpus} | {r.gpu} "
              f"{r.precision} | {_layout(c)} | {r.measured:.4g} | "
              f"{'-' if c.projected is None else f'{c.projected:.4g}'} | {_pct(c.error)} | "
              f"{c.rank or '-'} | {_pct(c.gap)} | {best} | {notes} |")
    gains = pair_gains(comparisons)
    if gains:
        print()
        print("| length pair | measured CP gain | projected CP gain | planner's best without CP |")
        print("|---|---|---|---|")
        for g in gains:
            print(f"| {g.key} | {g.measured:.2f}x | {g.projected:.2f}x | "
                  f"{g.without_cp.estimate.layout.label if g.without_cp.estimate else '-'} |")
    nocp = [c for c in comparisons if c.run.layout is None]
    if nocp and not args.no_best:  # the runs without CP whose layout is not published
        print()
        print("| run without CP | measured | best with TP in a node | TP <= 16 | TP <= 32 |")
        print("|---|---|---|---|---|")
        for c in nocp:
            cells = []
            for max_tp in (None, 16, 32):
                options = dataclasses.replace(run_options(c.run, True), max_tp=max_tp)
                ranked = plan(c.run.model, Batch.fixed_length(c.run.seq_length,
                                                              c.run.global_batch),
                              run_cluster(c.run), options).ranked
                e = next((x for x in ranked if x.fits and x.layout.cp == 1
                          and not x.layout.dynamic), None)
                cells.append("-" if e is None else
                             f"{e.layout.label}: {e.tokens_per_second_per_gpu:.4g} "
                             f"({_pct(e.tokens_per_second_per_gpu / c.measured - 1)})")
            print(f"| {c.run.id} | {c.measured:.4g} | {' | '.join(cells)} |")
    s = summarize(comparisons)
    print()
    print(s.line())
    if s.held_out:
        h = s.held_out
        print(f"held out of the fit: median |error| {100 * h['median_error']:.0f} % over "
              f"{h['runs']} runs ({h['within_20']} within 20 %), worst "
              f"{100 * h['worst_error']:.0f} %")
    if s.ranked:
        print(f"measured layout within 5 % of the planner's best: {s.within_5_of_best} of "
              f"{s.ranked}; largest gap {100 * s.worst_gap:.0f} % ({s.worst_gap_id})")
    disagree = [c.run.id for c in comparisons if c.run.in_summary and c.estimate is not None
                and c.run.layout is not None and not c.estimate.fits]
    print(f"published layouts the memory model says do not fit: {len(disagree)} "
          f"({', '.join(disagree)})")
    print()
    print("tokens/s per GPU derived from published TFLOP/s:")
    for r in runs:
        if r.published_unit == "tflops_per_gpu":
            print(f"- {r.id}: {r.derivation} = {r.measured:.4g}")


if __name__ == "__main__":
    main()
