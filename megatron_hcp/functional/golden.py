"""Golden values in megatron's GoldenValueMetric format and megatron-style comparison.

File: ``{"<metric>": {"start_step": 1, "end_step": N, "step_interval": 1,
"values": {"1": v1, ...}}, ...}``. Gated metrics (the rest is reported, never gated on CPU):

* ``lm loss``: each step equal, or within relative tolerance 0.05;
* ``num-zeros``: each step within relative tolerance 0.20;

and a metric passes when at least :data:`MIN_FRACTION` of the compared steps pass.

Nothing is lost or passes by accident: a golden file is validated when it is read (every step
from ``start_step`` to ``end_step`` present, finite numbers only, plain JSON: no NaN/Infinity,
no repeated key); every golden step must be in the run and every step of the run in the golden
values, and a non-finite value in a run is a failure. Golden files
are replaced only by :func:`replace_golden`: it refuses a run that is non-finite or shorter than
the recipe, writes atomically (temporary file, fsync, rename) and reports the change per step.
One regeneration at a time: :func:`golden_lock` holds a golden file's lock (``<file>.lock``,
``flock``) from before training until the file is replaced; a second one is refused at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import MAX_INT, MAX_STEPS
from ..files.atomic_write import (
    OutputPathError,
    check_output_dir,
    naming_write_errors,
    reclaim_temps,
    write_atomic,
)
from ..files.bounded_read import InputFileError, read_json

__all__ = ["GATED", "MIN_FRACTION", "Comparison", "GoldenError", "compare", "golden_lock",
           "golden_steps", "load_golden", "replace_golden", "to_golden", "validate_golden",
           "write_golden"]

GATED = {"lm loss": 0.05, "num-zeros": 0.20}
REPORTED = ("iteration-time", "mem-allocated-bytes")
MIN_FRACTION = 0.95
METRICS = ("lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")
MAX_GOLDEN_BYTES = 8 << 20  # 4 metrics x MAX_STEPS steps fit in a few MB


class GoldenError(ValueError):
    """A golden file or a run's metrics that cannot be trusted (named: file, metric, step)."""


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= MAX_INT if isinstance(value, int) else math.isfinite(value)


def golden_steps(block: Mapping) -> list[int]:
    """The steps a golden metric block promises: ``start_step..end_step`` by ``step_interval``."""
    return list(range(block["start_step"], block["end_step"] + 1, block["step_interval"]))


def validate_golden(golden: Any, where: str = "golden values") -> dict[str, dict]:
    """Check the golden-values structure; raise :class:`GoldenError` naming what is wrong."""
    if not isinstance(golden, dict):
        raise GoldenError(f"{where}: must be a JSON object of metrics; regenerate it with "
                          "`megatron-hcp functional update-golden NAME`")
    for name in GATED:
        if name not in golden:
            raise GoldenError(f"{where}: gated metric {name!r} is missing; regenerate it with "
                              "`megatron-hcp functional update-golden NAME`")
    for name, block in golden.items():
        if not isinstance(block, dict) or "values" not in block or not isinstance(
                block["values"], dict):
            raise GoldenError(f"{where}: {name!r} must hold start_step, end_step, "
                              "step_interval and values")
        for key in ("start_step", "end_step", "step_interval"):
            value = block.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GoldenError(f"{where}: {name!r} {key}={value!r} must be an integer >= 1")
            if value > MAX_STEPS:
                raise GoldenError(f"{where}: {name!r} {key}={value} is over the limit of "
                                  f"{MAX_STEPS} steps; regenerate it with `megatron-hcp "
                                  "functional update-golden NAME`")
        if block["end_step"] < block["start_step"]:
            raise GoldenError(f"{where}: {name!r} end_step={block['end_step']} < "
                              f"start_step={block['start_step']}")
        want = golden_steps(block)
        have = block["values"]
        missing = [s for s in want if str(s) not in have]
        extra = sorted(set(have) - {str(s) for s in want})
        if missing or extra:
            raise GoldenError(f"{where}: {name!r} values must cover steps {want[0]}..{want[-1]} "
                              f"exactly; missing {missing[:10]}, unexpected {extra[:10]} "
                              "(truncated or edited file?)")
        bad = [(s, have[str(s)]) for s in want if not _finite_number(have[str(s)])]
        if bad:
            raise GoldenError(f"{where}: {name!r} step {bad[0][0]} is {bad[0][1]!r}; golden "
                              "values must be finite numbers")
    return golden


def load_golden(path: Path) -> dict[str, dict]:
    """Read and validate a golden file (plain JSON: NaN/Infinity are refused)."""
    try:
        golden = read_json(path, "golden values", max_bytes=MAX_GOLDEN_BYTES)
    except InputFileError as err:
        raise GoldenError(f"{path}: cannot read golden values ({err.rule}); regenerate it "
                          "with `megatron-hcp functional update-golden NAME`") from None
    return validate_golden(golden, str(path))


def to_golden(metrics: dict[str, dict[Any, float]]) -> dict[str, dict]:
    """Per-step metrics (``{name: {step: value}}``) in the golden-values format."""
    out = {}
    for name in METRICS:
        values = {int(k): float(v) for k, v in metrics[name].items()}
        steps = sorted(values)
        out[name] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
                     "values": {str(s): values[s] for s in steps}}
    return out


def _check_run(metrics: Mapping[str, Mapping[Any, float]], steps: int) -> None:
    """A run fit to become golden values: every metric, steps 1..``steps``, all finite."""
    runs = {name: {int(k): v for k, v in metrics.get(name, {}).items()} for name in METRICS}
    for name, got in runs.items():  # divergence first: it says more than the length
        bad = [s for s in sorted(got) if not _finite_number(got[s])]
        if bad:
            raise GoldenError(f"refusing to update golden values: {name!r} at step {bad[0]} is "
                              f"{got[bad[0]]} (the run diverged); fix the run first")
    for name, got in runs.items():
        missing = [s for s in range(1, steps + 1) if s not in got]
        if missing:
            raise GoldenError(f"refusing to update golden values: {name!r} has no value for "
                              f"steps {missing[:10]} (the recipe trains {steps} steps; the run "
                              "was shorter)")


def write_golden(path: Path, metrics: dict[str, dict[Any, float]]) -> dict[str, dict]:
    """Write ``metrics`` as golden values atomically (:func:`~..files.atomic_write.write_atomic`:
    a temporary file named after this process, fsync, rename, fsync dir); temporary files of
    an earlier, interrupted write are removed first."""
    golden = validate_golden(to_golden(metrics), "new golden values")
    path = Path(path)
    reclaim_temps(path)
    write_atomic(path, json.dumps(golden, indent=2, allow_nan=False) + "\n")
    return golden


def replace_golden(path: Path, metrics: dict[str, dict[Any, float]], steps: int,
                   label: str = "") -> list[str]:
    """Replace the golden file with a finished run of ``steps`` steps; lines per changed step.

    Refuses (:class:`GoldenError`, file untouched) a run with a non-finite value or fewer steps.
    """
    _check_run(metrics, steps)
    label = label or Path(path).parent.name
    old = None
    lines = []
    if Path(path).is_file():
        try:
            old = load_golden(path)
        except GoldenError as err:
            lines.append(f"{label}: replacing unreadable golden values ({err})")
    new = to_golden(metrics)
    if old is None and not lines:
        lines.append(f"{label}: new golden values ({new['lm loss']['end_step']} steps)")
    for name in GATED:
        before = {int(k): v for k, v in (old or {}).get(name, {}).get("values", {}).items()}
        after = {int(k): v for k, v in new[name]["values"].items()}
        changed = 0
        for s in sorted(set(before) | set(after)):
            a, b = before.get(s), after.get(s)
            if a == b:
                continue
            changed += 1
            rel = (abs(b - a) / max(abs(a), 1e-12)) if a is not None and b is not None else None
            lines.append(f"{label}: {name} step {s}: {a if a is not None else '-'} -> "
                         f"{b if b is not None else '-'}"
                         + (f" (relative change {rel:.3e})" if rel is not None else ""))
        lines.append(f"{label}: {name}: {changed} of {len(set(before) | set(after))} steps "
                     "changed")
    write_golden(path, metrics)
    return lines


LOCK_SUFFIX = ".lock"


@contextlib.contextmanager
def golden_lock(path: Path) -> Iterator[Path]:
    """Hold the exclusive lock of the golden file ``path`` (``<file>.lock`` beside it, ``flock``)
    for the block; yields the lock file, removed when the block ends.

    Taken before training and without waiting: a second regeneration of the same file is
    refused at once (:class:`GoldenError` naming the file and the holder's pid), instead of
    training beside the first and reporting changes against a file the first one replaces.
    The folder is checked first: a full or read-only file system is refused before training."""
    path = Path(path)
    try:
        check_output_dir(path.parent, "the golden values' folder")
    except OutputPathError as err:
        raise GoldenError(f"golden values {path}: {err}") from None
    lock = path.with_name(path.name + LOCK_SUFFIX)
    with naming_write_errors(lock):
        fd = _take_lock(lock, path)
    try:
        yield lock
    finally:
        lock.unlink(missing_ok=True)  # while still held: a waiting opener sees a new file
        os.close(fd)


def _take_lock(lock: Path, golden: Path) -> int:
    """Open ``lock`` and take its flock without waiting; write this process's pid into it.
    Retries when the holder removed the file between the open and the flock (the lock then
    held would be on a file nobody else sees)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GoldenError(
                f"golden values {golden}: another update-golden run (pid {_holder(lock)}) holds "
                f"its lock {lock}; wait for it to finish, or end it, and run again") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            seen = os.stat(lock)
        except FileNotFoundError:
            seen = None
        mine = os.fstat(fd)
        if seen is not None and (seen.st_dev, seen.st_ino) == (mine.st_dev, mine.st_ino):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _holder(lock: Path) -> str:
    """The pid written in a lock file ("unknown" while its holder has not written it yet)."""
    try:
        text = lock.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return "unknown"
    return text if text.isascii() and text.isdecimal() else "unknown"


@dataclass
class Comparison:
    """Result of comparing one run with its golden values."""

    passed: bool
    lines: list[str] = field(default_factory=list)
    max_loss_rel: float = 0.0
    steps: int = 0


def _rel(got: float, want: float) -> float:
    if not (math.isfinite(got) and math.isfinite(want)):
        return math.inf
    return 0.0 if got == want else abs(got - want) / max(abs(want), 1e-12)


def compare(actual: dict[str, dict[Any, float]], golden: dict[str, dict]) -> Comparison:
    """Compare a run's per-step metrics with golden values (module docstring rules)."""
    validate_golden(golden)
    ok = True
    lines: list[str] = []
    max_loss = 0.0
    n_steps = 0
    for name, rtol in GATED.items():
        steps = golden_steps(golden[name])
        want = {s: float(golden[name]["values"][str(s)]) for s in steps}
        got = {int(k): float(v) for k, v in actual.get(name, {}).items()}
        missing = [s for s in steps if s not in got]
        if missing:
            lines.append(f"{name}: FAIL the run has no value for golden steps {missing[:10]} "
                         f"(golden covers {steps[0]}..{steps[-1]}; the run was shorter)")
            ok = False
            continue
        uncovered = sorted(set(got) - set(steps))
        if uncovered:
            lines.append(f"{name}: FAIL the golden values cover steps {steps[0]}..{steps[-1]} "
                         f"but the run has steps {uncovered[:10]} too (a truncated or edited "
                         "golden file checks nothing there); regenerate it with "
                         "`megatron-hcp functional update-golden NAME`")
            ok = False
            continue
        rels = [_rel(got[s], want[s]) for s in steps]
        passing = sum(r <= rtol for r in rels)
        fraction = passing / len(steps)
        nonfinite = [s for s in steps if not math.isfinite(got[s])]
        good = fraction >= MIN_FRACTION and not nonfinite
        ok &= good
        worst = max(range(len(steps)), key=lambda i: rels[i])
        lines.append(
            f"{name}: {'PASS' if good else 'FAIL'} {passing}/{len(steps)} steps within rtol "
            f"{rtol} (need {MIN_FRACTION:.0%}); largest deviation {rels[worst]:.3e} at step "
            f"{steps[worst]} (run {got[steps[worst]]:.6g}, golden {want[steps[worst]]:.6g})"
            + (f"; non-finite at steps {nonfinite[:10]}" if nonfinite else ""))
        if name == "lm loss":
            max_loss, n_steps = max(rels), len(steps)
    for name in REPORTED:
        if name in golden and name in actual:
            want = {int(k): float(v) for k, v in golden[name]["values"].items()}
            got = {int(k): float(v) for k, v in actual[name].items()}
            common = sorted(set(want) & set(got))
            if common:
                ratio = sum(got[s] for s in common) / max(sum(want[s] for s in common), 1e-12)
                lines.append(f"{name}: reported, not gated on CPU (run/golden = {ratio:.2f})")
    return Comparison(ok, lines, max_loss, n_steps)
