"""Projected vs measured tokens/s per GPU of the published runs (PNG, log-log)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...files.atomic_write import save_figure
from .compare import Comparison

__all__ = ["plot_comparisons"]


def plot_comparisons(comparisons: Sequence[Comparison], path: str) -> None:
    """One point per run with a projection (filled: published layout; open: the planner's
    best layout without CP stands in), one colour per source, the +-20 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [c for c in comparisons if c.projected]
    if not points:
        raise ValueError("no comparison with a projection to plot")
    fig, ax = plt.subplots(figsize=(8, 7))
    sources = sorted({c.run.source for c in points})
    colors = plt.get_cmap("tab10")
    for i, src in enumerate(sources):
        for exact in (True, False):
            sel = [c for c in points if c.run.source == src and (c.run.layout is not None) == exact]
            if not sel:
                continue
            ax.scatter([c.measured for c in sel], [c.projected for c in sel], s=36,
                       facecolors=colors(i) if exact else "none", edgecolors=colors(i),
                       label=src + ("" if exact else " (no CP, layout not published)"))
    lo = min(min(c.measured, c.projected) for c in points) / 1.5
    hi = max(max(c.measured, c.projected) for c in points) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey",
                    alpha=0.2, label="+-20 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured tokens/s per GPU (published)")
    ax.set_ylabel("projected tokens/s per GPU (megatron-hcp plan)")
    ax.set_title("layout planner vs published runs")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=100)
    plt.close(fig)
