"""Golden values in megatron's GoldenValueMetric format and megatron-style comparison.

File: ``{"<metric>": {"start_step": 1, "end_step": N, "step_interval": 1,
"values": {"1": v1, ...}}, ...}``. Gated metrics (the rest is reported, never gated on CPU):

* ``lm loss``: each step equal, or within relative tolerance 0.05;
* ``num-zeros``: each step within relative tolerance 0.20;

and a metric passes when at least :data:`MIN_FRACTION` of the compared steps pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GATED", "MIN_FRACTION", "Comparison", "compare", "load_golden", "to_golden",
           "write_golden"]

GATED = {"lm loss": 0.05, "num-zeros": 0.20}
REPORTED = ("iteration-time", "mem-allocated-bytes")
MIN_FRACTION = 0.95
METRICS = ("lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")


def to_golden(metrics: dict[str, dict[Any, float]]) -> dict[str, dict]:
    """Per-step metrics (``{name: {step: value}}``) in the golden-values format."""
    out = {}
    for name in METRICS:
        values = {int(k): float(v) for k, v in metrics[name].items()}
        steps = sorted(values)
        out[name] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
                     "values": {str(s): values[s] for s in steps}}
    return out


def load_golden(path: Path) -> dict[str, dict]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_golden(path: Path, metrics: dict[str, dict[Any, float]]) -> dict[str, dict]:
    golden = to_golden(metrics)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(golden, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return golden


def _values(block: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in block["values"].items()}


@dataclass
class Comparison:
    """Result of comparing one run with its golden values."""

    passed: bool
    lines: list[str] = field(default_factory=list)
    max_loss_rel: float = 0.0
    steps: int = 0


def compare(actual: dict[str, dict[Any, float]], golden: dict[str, dict]) -> Comparison:
    """Compare a run's per-step metrics with golden values (module docstring rules)."""
    ok = True
    lines: list[str] = []
    max_loss = 0.0
    n_steps = 0
    for name, rtol in GATED.items():
        if name not in golden:
            lines.append(f"{name}: missing from the golden values")
            ok = False
            continue
        want = _values(golden[name])
        got = {int(k): float(v) for k, v in actual[name].items()}
        common = sorted(set(want) & set(got))
        if not common:
            lines.append(f"{name}: no common steps (run {sorted(got)[:3]}..., golden "
                         f"{sorted(want)[:3]}...)")
            ok = False
            continue
        rels = [0.0 if got[s] == want[s] else
                abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in common]
        passing = sum(r <= rtol for r in rels)
        fraction = passing / len(common)
        good = fraction >= MIN_FRACTION and all(math.isfinite(got[s]) for s in common)
        ok &= good
        worst = max(range(len(common)), key=lambda i: rels[i])
        lines.append(
            f"{name}: {'PASS' if good else 'FAIL'} {passing}/{len(common)} steps within rtol "
            f"{rtol} (need {MIN_FRACTION:.0%}); largest deviation {rels[worst]:.3e} at step "
            f"{common[worst]} (run {got[common[worst]]:.6g}, golden {want[common[worst]]:.6g})")
        if name == "lm loss":
            max_loss, n_steps = max(rels), len(common)
    for name in REPORTED:
        if name in golden and name in actual:
            want = _values(golden[name])
            got = {int(k): float(v) for k, v in actual[name].items()}
            common = sorted(set(want) & set(got))
            if common:
                ratio = sum(got[s] for s in common) / max(sum(want[s] for s in common), 1e-12)
                lines.append(f"{name}: reported, not gated on CPU (run/golden = {ratio:.2f})")
    return Comparison(ok, lines, max_loss, n_steps)
