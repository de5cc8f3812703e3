"""Functional recipes in the contiguous CP layout (cp_partition_mode): a static one with a
sliding window and a dynamic-CP one on packed THD data; each equals its golden values, its run
without CP and its resumed run."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

RECIPES = ["gpt3_mcore_tp1_pp1_cp4_contiguous_swa", "gpt3_mcore_tp1_pp1_cp4_dcp_contiguous"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name):
    assert_recipe_passes(name)


def test_the_recipes_run_the_contiguous_layout():
    from megatron_hcp.functional.harness import recipe_dir
    from megatron_hcp.functional.recipe import load_recipe

    static, dynamic = (load_recipe(recipe_dir(n)) for n in RECIPES)
    assert static.config.cp_partition_mode == dynamic.config.cp_partition_mode == "contiguous"
    assert static.config.window_size == [16, 0] and not static.config.dynamic
    assert dynamic.config.dynamic and dynamic.spec.varlen is not None
