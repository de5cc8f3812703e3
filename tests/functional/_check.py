"""Shared body of the recipe tests: run one recipe like CI does and assert every check."""

from __future__ import annotations

from megatron_hcp.functional.harness import check_recipe

# CP=1 runs shared by the recipes of one test module whose CP=1 form is identical
CP1_RUNS: dict = {}


def assert_recipe_passes(name: str) -> None:
    result = check_recipe(name, echo=None, cp1_cache=CP1_RUNS)
    report = "\n".join(result.lines)
    assert result.passed, f"{name}:\n{report}"
    assert result.golden is not None and result.golden.steps == result.steps, report
