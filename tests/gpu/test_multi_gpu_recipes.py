"""Every shipped functional recipe under ``--platform gpu_nccl`` (NCCL, one GPU per rank, the
attention backend ``auto``), where the machine has as many GPUs as the recipe has ranks.

Compared with ``golden_values_dev_gpu_nccl.json`` where it was recorded (``./scripts/
gpu_check.sh --record-golden`` records it on a GPU node, only for the recipes that ran there),
else with the CPU golden values under the same rules (lm loss within rtol 0.05); plus the
harness's CP=1 invariance and resume checks."""

from __future__ import annotations

import pytest

from megatron_hcp.functional.golden import compare, load_golden
from megatron_hcp.functional.harness import check_recipe, recipe_dir
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe
from tests.gpu._need import needs
from tests.gpu._recipes import shipped_recipes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=needs(nproc)) for name, nproc in shipped_recipes().items()])
def test_recipe_under_gpu_nccl(report, name):
    recipe = load_recipe(recipe_dir(name))
    result = check_recipe(recipe, echo=None, launch=Launch(platform="gpu_nccl"))
    lines = [line for line in result.lines if not line.startswith("no golden values")]
    golden, source = result.golden, "gpu_nccl"
    if golden is None:  # not recorded for this platform yet: the CPU golden values
        golden, source = compare(result.metrics, load_golden(
            recipe.golden_path(platform="cpu_gloo"))), "cpu_gloo"
        lines += golden.lines
    report(recipe.nproc, f"lm loss vs {source} golden: max rel {golden.max_loss_rel:.1e}"
           + (f"; vs CP=1 {result.cp1_max_rel:.1e}" if result.cp1_max_rel is not None else "")
           + (f"; resume {result.resume_max_rel:.1e}" if result.resume_max_rel is not None
              else ""))
    assert golden.passed and all("FAIL" not in line for line in lines), "\n".join(lines)
