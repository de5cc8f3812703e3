"""Run recipes with torchrun on CPU/gloo, compare with golden values and with CP=1.

``run_recipe`` launches ``torch.distributed.run`` (rendezvous on 127.0.0.1, free port chosen by
the launcher) with :mod:`megatron_hcp.functional.worker`, streams the per-step progress lines
and returns the metrics rank 0 wrote. ``check_recipe`` runs everything a recipe's CI job checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .golden import Comparison, compare, load_golden, replace_golden
from .recipe import RECIPES_DIR, Recipe, load_recipe

__all__ = ["RecipeResult", "RecipeRunError", "check_recipe", "max_rel_deviation", "recipe_dir",
           "run_recipe", "summary_table", "update_golden"]

CP1_RTOL = 1e-5
RESUME_RTOL = 1e-6


class RecipeRunError(RuntimeError):
    """The ranks of a recipe failed; carries the tail of their log."""


def recipe_dir(name_or_path: str | os.PathLike) -> Path:
    """A recipe's directory: a path holding ``model_config.yaml``, or a shipped recipe name."""
    path = Path(name_or_path)
    if (path / "model_config.yaml").is_file():
        return path
    candidate = RECIPES_DIR / str(name_or_path)
    if not (candidate / "model_config.yaml").is_file():
        raise FileNotFoundError(f"no recipe {name_or_path!r} under {RECIPES_DIR}")
    return candidate


def run_recipe(recipe: Recipe, *, steps: int | None = None, cp1: bool = False,
               extra: list[str] | None = None, echo: Callable[[str], None] | None = print
               ) -> dict[str, dict[int, float]]:
    """Train ``recipe`` on ``recipe.nproc`` local ranks; return rank 0's per-step metrics."""
    with tempfile.TemporaryDirectory(prefix="megatron-hcp-") as tmp:
        out = Path(tmp) / "metrics.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               f"--nproc-per-node={recipe.nproc}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "-m", "megatron_hcp.functional.worker",
               str(recipe.path), "--out", str(out)]
        if steps:
            cmd += ["--steps", str(steps)]
        if cp1:
            cmd.append("--cp1")
        cmd += extra or []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "MASTER_ADDR": "127.0.0.1", **recipe.env}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        log: list[str] = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.append(line)
                if echo is not None and line.startswith("[") and "] step " in line:
                    echo(line.rstrip())
            code = proc.wait()
        if code != 0 or not out.is_file():
            errors = [line for line in log if re.search(r"\w+(Error|Exception): ", line)]
            tail = "".join(errors[:3]) + "".join(log[-40:])
            raise RecipeRunError(f"{recipe.name}{' (CP=1)' if cp1 else ''} failed with exit "
                                 f"code {code}; last lines:\n{tail}")
        raw = json.loads(out.read_text(encoding="utf-8"))
    return {name: {int(k): float(v) for k, v in values.items()} for name, values in raw.items()}


def max_rel_deviation(run: dict[int, float], reference: dict[int, float],
                      steps: range) -> float:
    """Largest relative deviation of ``run`` from ``reference`` over ``steps``; ``inf`` when a
    step is missing from either or a value is not finite (NaN never passes as 0)."""
    worst = 0.0
    for s in steps:
        if s not in run or s not in reference:
            return math.inf
        a, b = run[s], reference[s]
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst if len(steps) else math.inf


@dataclass
class RecipeResult:
    """What one recipe's check found."""

    name: str
    steps: int
    passed: bool
    golden: Comparison | None = None
    cp1_max_rel: float | None = None
    resume_max_rel: float | None = None
    lines: list[str] = field(default_factory=list)


def _run_with_resume(recipe: Recipe, steps: int, echo) -> tuple[dict, float]:
    """Uninterrupted run saving at the midpoint, then a run resumed from it."""
    half = max(1, steps // 2)
    with tempfile.TemporaryDirectory(prefix="megatron-hcp-ckpt-") as ckpt:
        full = run_recipe(recipe, steps=steps, echo=echo,
                          extra=["--checkpoint-dir", ckpt, "--save-at", str(half)])
        if echo:
            echo(f"[{recipe.name}] resuming from the checkpoint of step {half}")
        resumed = run_recipe(recipe, steps=steps, echo=echo,
                             extra=["--checkpoint-dir", ckpt, "--resume-from", str(half)])
    return full, max_rel_deviation(resumed["lm loss"], full["lm loss"], range(half + 1, steps + 1))


def _recipe(recipe: Recipe | str | os.PathLike) -> Recipe:
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe_dir(recipe))


def check_recipe(recipe: Recipe | str, *, steps: int | None = None, cp_invariance: bool = True,
                 echo: Callable[[str], None] | None = print,
                 cp1_cache: dict | None = None) -> RecipeResult:
    """Run a recipe, compare with golden values, with CP=1 and (ckpt-resume) after resuming.

    ``cp1_cache`` (optional, caller-owned) reuses the CP=1 run of recipes whose CP=1 form is
    the same model, data and layout (e.g. the p2p / all_gather / a2a family)."""
    recipe = _recipe(recipe)
    n = steps or recipe.spec.steps
    golden_file = recipe.golden_path()
    golden = load_golden(golden_file) if golden_file.is_file() else None  # before training
    result = RecipeResult(recipe.name, n, True)
    if recipe.test_type == "ckpt-resume":
        metrics, result.resume_max_rel = _run_with_resume(recipe, n, echo)
        good = result.resume_max_rel <= RESUME_RTOL
        result.passed &= good
        result.lines.append(f"ckpt-resume: {'PASS' if good else 'FAIL'} losses after resuming "
                            f"deviate by {result.resume_max_rel:.3e} (limit {RESUME_RTOL})")
    else:
        metrics = run_recipe(recipe, steps=n, echo=echo)
    if golden is not None:
        result.golden = compare(metrics, golden)
        result.passed &= result.golden.passed
        result.lines += result.golden.lines
    else:
        result.passed = False
        result.lines.append(f"no golden values at {golden_file}: run `megatron-hcp functional "
                            f"update-golden {recipe.name}`")
    cp = recipe.config.context_parallel_size
    if cp_invariance and cp > 1:
        flat = recipe.with_cp1()
        key = repr((flat.config, dataclasses.replace(flat.spec, steps=n), flat.decentralized,
                    flat.nproc))
        if cp1_cache is not None and key in cp1_cache:
            base = cp1_cache[key]
        else:
            base = run_recipe(recipe, steps=n, cp1=True, echo=echo)
            if cp1_cache is not None:
                cp1_cache[key] = base
        result.cp1_max_rel = max_rel_deviation(metrics["lm loss"], base["lm loss"],
                                               range(1, n + 1))
        good = result.cp1_max_rel <= CP1_RTOL
        result.passed &= good
        result.lines.append(f"CP invariance: {'PASS' if good else 'FAIL'} lm loss vs the same "
                            f"run with CP=1 deviates by {result.cp1_max_rel:.3e} "
                            f"(limit {CP1_RTOL})")
    return result


def update_golden(recipe: Recipe | str, *, echo: Callable[[str], None] | None = print
                  ) -> list[str]:
    """Regenerate a recipe's golden values; return lines saying what changed per step.

    A failed run raises :class:`RecipeRunError`; a diverged (non-finite) or short run is
    refused by :func:`~.golden.replace_golden`; either way the golden file is untouched."""
    recipe = _recipe(recipe)
    metrics = run_recipe(recipe, echo=echo)
    return replace_golden(recipe.golden_path(), metrics, recipe.spec.steps, recipe.name)


def summary_table(results: list[RecipeResult]) -> str:
    """Recipe | steps | result | max loss deviation vs golden | vs CP=1."""
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2e}"

    rows = [("recipe", "steps", "result", "vs golden", "vs CP=1", "resume")]
    for r in results:
        rows.append((r.name, str(r.steps), "PASS" if r.passed else "FAIL",
                     fmt(r.golden.max_loss_rel if r.golden else None), fmt(r.cp1_max_rel),
                     fmt(r.resume_max_rel)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)
