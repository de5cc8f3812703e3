"""Functional recipes: dynamic CP with PP + VPP, dynamic hierarchical CP, decentralized HCP."""

from __future__ import annotations

import pytest

from tests.functional._check import CP1_RUNS, LAUNCH, assert_recipe_passes

HCP_RECIPE = "gpt3_mcore_tp1_pp1_cp8_dcp_a2a_p2p"  # checked by its own test below
RECIPES = ["gpt3_mcore_tp1_pp2_vpp2_cp2_dcp", "gpt3_mcore_tp2_pp1_cp4_a2a_p2p_decentralized_pg",
           HCP_RECIPE]


@pytest.mark.multirank
@pytest.mark.parametrize("name", [r for r in RECIPES if r != HCP_RECIPE])
def test_recipe(name):
    assert_recipe_passes(name)


@pytest.mark.multirank
def test_dynamic_hcp_recipe_runs_hierarchical_groups():
    """The dynamic HCP recipe really switches levels: some micro-batches run 8-rank groups
    (a2a 2 x p2p 4), and hierarchical groups run in every step; it equals golden and CP=1."""
    from megatron_hcp.functional.harness import check_recipe

    result = check_recipe(HCP_RECIPE, echo=None, cp1_cache=CP1_RUNS, launch=LAUNCH)
    assert result.passed, "\n".join(result.lines)
    largest, hierarchical = (result.metrics["max-cp-group-size"],
                             result.metrics["hierarchical-cp-groups"])
    assert max(largest.values()) == 8, largest
    assert all(n >= 1 for n in hierarchical.values()), hierarchical


def test_every_recipe_is_tested():
    from megatron_hcp.functional.recipe import list_recipes
    from tests.functional import (
        test_recipes_bridge,
        test_recipes_main_job,
        test_recipes_partition_layout,
        test_recipes_resume,
        test_recipes_static_cp,
        test_recipes_tp_pp_cp,
    )

    tested = [*RECIPES, *test_recipes_main_job.RECIPES, *test_recipes_resume.RECIPES,
              *test_recipes_static_cp.RECIPES, *test_recipes_tp_pp_cp.RECIPES,
              *test_recipes_bridge.RECIPES, *test_recipes_partition_layout.RECIPES]
    assert sorted(tested) == list_recipes()
