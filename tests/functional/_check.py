"""Shared body of the recipe tests: run one recipe like CI does and assert every check."""

from __future__ import annotations

from pathlib import Path

from megatron_hcp.functional.harness import check_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.plot import plot_result

# CP=1 runs shared by the recipes of one test module whose CP=1 form is identical
CP1_RUNS: dict = {}
# ranks forked after torch and megatron-core are imported once per test worker: the same
# training as torchrun's (test_forked_launch compares them bit for bit), without the imports
LAUNCH = Launch(launcher="forkserver")


def assert_recipe_passes(name: str, plot_dir: Path | None = None):
    """Run and check ``name``; with ``plot_dir`` also write its loss plot and check the PNG."""
    result = check_recipe(name, echo=None, cp1_cache=CP1_RUNS, launch=LAUNCH)
    report = "\n".join(result.lines)
    assert result.passed, f"{name}:\n{report}"
    assert result.golden is not None and result.golden.steps == result.steps, report
    if plot_dir is not None:
        assert result.golden_loss and result.cp1_loss, "plot curves not kept"
        path = plot_result(result, plot_dir)
        assert path == plot_dir / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    return result
