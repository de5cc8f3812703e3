"""Loss curves of a recipe check (matplotlib Agg, no display needed).

One PNG per recipe: the run's lm loss, the golden values and the CP=1 run over steps, and for
ckpt-resume recipes the resumed run and a line at the resume point.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..files.atomic_write import naming_write_errors, save_figure
from .harness import RecipeResult

__all__ = ["plot_result"]


def _curve(ax, values: dict[int, float] | None, label: str, **style) -> None:
    if values:
        steps = sorted(values)
        ax.plot(steps, [values[s] for s in steps], label=label, **style)


def plot_result(result: RecipeResult, out_dir: str | os.PathLike) -> Path:
    """Write ``<out_dir>/<recipe>.png``; return its path. Needs the curves ``check_recipe`` kept."""
    if not result.loss:
        raise ValueError(f"plot: recipe {result.name!r} has no lm loss values to plot (the run "
                         "produced none); rerun it with `megatron-hcp functional run`")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    with naming_write_errors(out):  # a full file system: one line naming the folder
        out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _curve(ax, result.golden_loss, "golden values", color="black", linewidth=3, alpha=0.35)
    _curve(ax, result.cp1_loss, "CP=1 run", color="tab:orange", linestyle="--", marker="x",
           markersize=4)
    _curve(ax, result.loss, "run", color="tab:blue", marker=".", markersize=5)
    _curve(ax, result.resumed_loss, "resumed run", color="tab:green", linestyle=":",
           marker="o", markersize=3, fillstyle="none")
    if result.resume_step is not None:
        ax.axvline(result.resume_step, color="tab:red", linewidth=1,
                   label=f"resume point (step {result.resume_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("lm loss")
    ax.set_title(f"{result.name}: {'PASS' if result.passed else 'FAIL'}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / f"{result.name}.png"
    save_figure(fig, Path(path), dpi=100)
    plt.close(fig)
    return path
