"""Gantt chart of a dynamic-CP plan: ranks x micro-batches (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..files.atomic_write import save_figure
from .scheduler import Plan
from .workload import GPTWorkload

__all__ = ["plot_plan"]


def plot_plan(plan: Plan, lengths: Sequence[int], workload: GPTWorkload, path: str) -> None:
    """Each group is a bar over its ranks; micro-batches start where the slowest rank ended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(r for mb in plan.micro_batches for g in mb.groups for r in g.ranks) + 1
    fig, ax = plt.subplots(figsize=(10, max(3, n / 8)))
    start = 0.0
    colors = plt.get_cmap("tab10")
    for j, mb in enumerate(plan.micro_batches):
        end = start
        for g in mb.groups:
            c = len(g.ranks)
            width = sum(workload.cost(lengths[s], c) for s in g.samples)
            ax.broken_barh([(start, width)], (g.ranks[0], c), facecolors=colors(j % 10),
                           edgecolors="black", linewidth=0.3)
            end = max(end, start + width)
        ax.axvline(end, color="grey", linewidth=0.5)
        start = end
    summary = plan.summary
    ax.set_xlabel("cost (per-rank work; a barrier ends every micro-batch)")
    ax.set_ylabel("DPxCP rank")
    ax.set_ylim(0, n)
    ax.set_title(f"{len(plan.micro_batches)} micro-batches, efficiency "
                 f"{summary.get('efficiency', 0):.3f}")
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=100)
    plt.close(fig)
