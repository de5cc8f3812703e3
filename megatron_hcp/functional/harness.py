"""Run recipes with torchrun on CPU/gloo, compare with golden values and with CP=1.

``run_recipe`` launches ``torch.distributed.run`` (by default one node, rendezvous on
127.0.0.1, free port chosen by the launcher; :class:`~.launch.Launch` for several nodes) with
:mod:`megatron_hcp.functional.worker`, streams the per-step progress lines and returns the
metrics rank 0 wrote. ``check_recipe`` runs everything a recipe's CI job checks.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..files.atomic_write import reclaim_temps
from ..files.bounded_read import read_json
from .bridge_recipe import BridgeRecipe
from .golden import Comparison, compare, golden_lock, load_golden, replace_golden
from .launch import Launch
from .recipe import RECIPES_DIR, Recipe, load_recipe
from .signals import end_processes, raising_signals, signal_of

__all__ = ["RecipeResult", "RecipeRunError", "check_recipe", "failure_summary", "max_rel_deviation",
           "rank_exceptions", "recipe_dir", "run_recipe", "summary_table", "update_golden"]

CP1_RTOL = 1e-5
RESUME_RTOL = 1e-6


class RecipeRunError(RuntimeError):
    """The ranks of a recipe failed; carries the tail of their log."""


def recipe_dir(name_or_path: str | os.PathLike) -> Path:
    """A recipe's directory: a path holding ``model_config.yaml``, or a shipped recipe name."""
    for path in (Path(name_or_path), RECIPES_DIR / str(name_or_path)):
        try:
            if (path / "model_config.yaml").is_file():
                return path
        except OSError:  # e.g. a name longer than the file system allows: no such recipe
            continue
    shown = str(name_or_path)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise FileNotFoundError(f"no recipe {shown!r} under {RECIPES_DIR}")


def run_recipe(recipe: Recipe, *, steps: int | None = None, cp1: bool = False,
               extra: list[str] | None = None, echo: Callable[[str], None] | None = print,
               launch: Launch | None = None) -> dict[str, dict[int, float]]:
    """Train ``recipe`` on ``recipe.nproc`` ranks; return rank 0's per-step metrics (``{}`` on
    a node other than node 0, which has no rank 0).

    Everything of the run lives in one temporary directory (the metrics, torchrun's logs,
    torchinductor's cache), removed when it ends, also when this process is told to end
    (:mod:`.signals`: the launcher and every rank end first)."""
    launch = launch or Launch()
    launch.validate(recipe.nproc)
    with raising_signals(), tempfile.TemporaryDirectory(prefix="megatron-hcp-") as tmp:
        out = Path(tmp) / "metrics.json"
        args = [str(recipe.path), "--out", str(out), "--platform", launch.platform,
                *recipe.worker_args(tmp)]
        if steps:
            args += ["--steps", str(steps)]
        if cp1:
            args.append("--cp1")
        args += extra or []
        # a CPU run's ranks see no GPU: nothing in them (torch's own probes included) can
        # initialize CUDA on a machine that has it
        hidden = {"CUDA_VISIBLE_DEVICES": ""} if launch.platform == "cpu_gloo" else {}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "MASTER_ADDR": launch.master_addr,
               # torchinductor's cache (else $TMPDIR/torchinductor_<user>, left behind)
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "torchinductor"),
               **recipe.env, **hidden}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

        def show(line: str) -> None:
            if echo is not None and line.startswith("[") and "] step " in line:
                echo(line.rstrip())

        if launch.launcher == "forkserver":
            from .forked import run_forked

            code, log = run_forked(recipe.worker, args, recipe.nproc, env,
                                   master_addr=launch.master_addr, on_line=show)
        else:
            code, log = _torchrun(recipe, launch, args, env, show,
                                  log_dir=str(Path(tmp) / "torchrun"))
        if code == 0 and not launch.checks_results:
            return {}
        if code != 0 or not out.is_file():
            raise RecipeRunError(f"{recipe.name}{' (CP=1)' if cp1 else ''} failed with exit "
                                 f"code {code}; {failure_summary(log)}")
        raw = read_json(out, "rank 0's metrics", finite=False)  # a diverged run has NaN
    return {name: {int(k): float(v) for k, v in values.items()} for name, values in raw.items()}


_STREAM = re.compile(r"\[(rank\d+|launcher)\]: ?(.*)")  # a rank's line, as torchrun prefixes it
_LAUNCHER_ERRORS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",)
_ABORT = re.compile(r"terminate called|\s*what\(\): ")


def rank_exceptions(log: list[str]) -> list[str]:
    """Each failing rank's exception line: the last exception line (the first unindented line
    after ``Traceback (most recent call last):``, or a C++ abort's ``terminate called`` /
    ``what():``) of each rank's output, in rank order, as ``[rankN]: XxxError: ...``.

    Lines without a rank's prefix (a rank that failed before its process group existed, as
    torchrun's ranks are prefixed only after; torchrun's own) are one more stream, shown as
    ``[rank?]``; torchrun's own ChildFailedError is left out (it names no cause)."""
    last: dict[str, str] = {}
    in_traceback: set[str] = set()
    for raw in log:
        match = _STREAM.match(raw)
        name, text = (match.group(1), match.group(2)) if match else ("rank?", raw)
        text = text.rstrip("\n")
        if text.startswith("Traceback (most recent call last):"):
            in_traceback.add(name)
        elif name in in_traceback and text.strip() and not text[0].isspace():
            in_traceback.discard(name)
            if not text.startswith(_LAUNCHER_ERRORS):
                last[name] = text
        elif _ABORT.match(text):  # a C++ exception that ended the process
            last[name] = text.strip()

    def order(name: str) -> tuple[int, int]:
        return (0, int(name[4:])) if name[4:].isascii() and name[4:].isdecimal() else (1, 0)

    return [f"[{name}]: {last[name]}" for name in sorted(last, key=order)]


def failure_summary(log: list[str], tail: int = 40) -> str:
    """What a failed run's error shows: the last ``tail`` lines of its output, then each
    failing rank's exception line (:func:`rank_exceptions`), so that the cause comes last
    whatever the tail holds; a run that printed no traceback ends with its first error-like
    lines."""
    text = "last lines:\n" + "".join(log[-tail:])
    causes = rank_exceptions(log)
    if not causes:
        causes = [line.rstrip("\n") for line in log
                  if re.search(r"\w+(Error|Exception): ", line)][:3]
    if causes:
        text += ("" if text.endswith("\n") else "\n") + "each failing rank's exception:\n"
        text += "\n".join(causes)
    return text


def _torchrun(recipe: Recipe, launch: Launch, args: list[str], env: dict[str, str],
              show: Callable[[str], None], log_dir: str) -> tuple[int, list[str]]:
    """``torchrun ... -m <worker> args``: its exit code and output lines. torchrun runs in a
    process group of its own (each rank in another, torchrun's doing), so that when this
    process is told to end (Ctrl-C, SIGTERM, SIGHUP: :mod:`.signals`) or fails, the signal
    reaches torchrun and every rank, and SIGKILL after a grace period."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch.torchrun_args(recipe.nproc),
           f"--log-dir={log_dir}", "-m", recipe.worker, *args]
    log: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, process_group=0) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.append(line)
                show(line)
        except BaseException as exc:  # the run ends with this process, never without it
            end_processes(proc.pid, signal_of(exc))
            raise
        return proc.wait(), log


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
    loss: dict[int, float] = field(default_factory=dict)  # the curves, for plots
    golden_loss: dict[int, float] | None = None
    cp1_loss: dict[int, float] | None = None
    resumed_loss: dict[int, float] | None = None
    resume_step: int | None = None
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)  # rank 0's, per step


def _run_with_resume(recipe: Recipe, steps: int, echo, launch: Launch | None = None
                     ) -> tuple[dict, dict, int]:
    """Uninterrupted run saving at the midpoint, then a run resumed from it: both runs' metrics
    and the resume step. The checkpoint folder is removed also when a signal ends the runs
    (:mod:`.signals`, active from before it exists)."""
    half = max(1, steps // 2)
    with raising_signals(), tempfile.TemporaryDirectory(prefix="megatron-hcp-ckpt-") as ckpt:
        full = run_recipe(recipe, steps=steps, echo=echo, launch=launch,
                          extra=["--checkpoint-dir", ckpt, "--save-at", str(half)])
        if echo:
            echo(f"[{recipe.name}] resuming from the checkpoint of step {half}")
        resumed = run_recipe(recipe, steps=steps, echo=echo, launch=launch,
                             extra=["--checkpoint-dir", ckpt, "--resume-from", str(half)])
    return full, resumed, half


def _recipe(recipe: Recipe | BridgeRecipe | str | os.PathLike) -> Recipe | BridgeRecipe:
    if isinstance(recipe, (Recipe, BridgeRecipe)):
        return recipe
    return load_recipe(recipe_dir(recipe))


def check_recipe(recipe: Recipe | str, *, steps: int | None = None, cp_invariance: bool = True,
                 echo: Callable[[str], None] | None = print,
                 cp1_cache: dict | None = None, launch: Launch | None = None) -> RecipeResult:
    """Run a recipe, compare with golden values, with CP=1 and (ckpt-resume) after resuming.

    ``cp1_cache`` (optional, caller-owned) reuses the CP=1 run of recipes whose CP=1 form is
    the same model, data and layout (e.g. the p2p / all_gather / a2a family). ``launch``: nodes
    and platform (golden file ``golden_values_dev_<platform>.json``); on a node other than 0
    the runs take part and node 0 checks."""
    recipe = _recipe(recipe)
    launch = launch or Launch()
    n = steps or recipe.steps
    golden_file = recipe.golden_path(platform=launch.platform)
    # before training; anything at the path (a directory, a FIFO) is read and refused
    golden = load_golden(golden_file) if os.path.lexists(golden_file) else None
    result = RecipeResult(recipe.name, n, True)
    if not launch.checks_results:
        return _take_part(recipe, n, cp_invariance, echo, launch)
    if recipe.test_type == "ckpt-resume":
        metrics, resumed, half = _run_with_resume(recipe, n, echo, launch)
        result.resume_step = half
        result.resumed_loss = {s: v for s, v in resumed["lm loss"].items() if s > half}
        result.resume_max_rel = max_rel_deviation(resumed["lm loss"], metrics["lm loss"],
                                                  range(half + 1, n + 1))
        good = result.resume_max_rel <= RESUME_RTOL
        result.passed &= good
        result.lines.append(f"ckpt-resume: {'PASS' if good else 'FAIL'} losses after resuming "
                            f"deviate by {result.resume_max_rel:.3e} (limit {RESUME_RTOL})")
    else:
        metrics = run_recipe(recipe, steps=n, echo=echo, launch=launch)
    result.loss = dict(metrics["lm loss"])
    result.metrics = metrics
    if golden is not None:
        result.golden_loss = {int(k): float(v) for k, v in golden["lm loss"]["values"].items()}
        result.golden = compare(metrics, golden)
        result.passed &= result.golden.passed
        result.lines += result.golden.lines
    else:
        result.passed = False
        result.lines.append(f"no golden values at {golden_file}: run `megatron-hcp functional "
                            f"update-golden {recipe.name} --platform {launch.platform}`")
    cp = recipe.config.context_parallel_size
    if cp_invariance and cp > 1:
        flat = recipe.with_cp1()
        key = flat.cache_key(n)
        if cp1_cache is not None and key in cp1_cache:
            base = cp1_cache[key]
        else:
            base = run_recipe(recipe, steps=n, cp1=True, echo=echo, launch=launch)
            if cp1_cache is not None:
                cp1_cache[key] = base
        result.cp1_loss = dict(base["lm loss"])
        result.cp1_max_rel = max_rel_deviation(metrics["lm loss"], base["lm loss"],
                                               range(1, n + 1))
        good = result.cp1_max_rel <= CP1_RTOL
        result.passed &= good
        result.lines.append(f"CP invariance: {'PASS' if good else 'FAIL'} lm loss vs the same "
                            f"run with CP=1 deviates by {result.cp1_max_rel:.3e} "
                            f"(limit {CP1_RTOL})")
    return result


def _take_part(recipe: Recipe, n: int, cp_invariance: bool, echo, launch: Launch
               ) -> RecipeResult:
    """A node other than node 0: start the same runs in the same order, check nothing."""
    if recipe.test_type == "ckpt-resume":
        _run_with_resume(recipe, n, echo, launch)
    else:
        run_recipe(recipe, steps=n, echo=echo, launch=launch)
    if cp_invariance and recipe.config.context_parallel_size > 1:
        run_recipe(recipe, steps=n, cp1=True, echo=echo, launch=launch)
    return RecipeResult(recipe.name, n, True, lines=[
        f"node {launch.node_rank} of {launch.nnodes}: ranks ran; node 0 checks the results"])


def update_golden(recipe: Recipe | str, *, echo: Callable[[str], None] | None = print,
                  launch: Launch | None = None) -> list[str]:
    """Regenerate the platform's golden values (``golden_values_dev_<platform>.json``); return
    lines saying what changed per step.

    The golden file's lock (:func:`~.golden.golden_lock`) is taken before training: a second
    update of the same file, or a folder that cannot be written, is refused at once with a
    :class:`~.golden.GoldenError`. A failed run raises :class:`RecipeRunError`; a diverged
    (non-finite) or short run is refused by :func:`~.golden.replace_golden`; either way the
    golden file is untouched."""
    recipe = _recipe(recipe)
    launch = launch or Launch()
    if not launch.checks_results:
        run_recipe(recipe, echo=echo, launch=launch)
        return [f"{recipe.name}: node {launch.node_rank} ran; node 0 writes the golden values"]
    path = recipe.golden_path(platform=launch.platform)
    with golden_lock(path):
        reclaim_temps(path)  # of an interrupted run
        metrics = run_recipe(recipe, echo=echo, launch=launch)
        return replace_golden(path, metrics, recipe.steps, recipe.name)


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
