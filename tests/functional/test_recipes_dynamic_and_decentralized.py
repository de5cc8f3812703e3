"""Functional recipes: dynamic CP (TP, VPP) and decentralized HCP."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

RECIPES = ["gpt3_mcore_tp2_pp1_cp4_dcp", "gpt3_mcore_tp1_pp2_vpp2_cp2_dcp",
           "gpt3_mcore_tp2_pp1_cp4_a2a_p2p_decentralized_pg"]
HCP_RECIPE = "gpt3_mcore_tp1_pp1_cp8_dcp_a2a_p2p"  # checked by its own test below


MAIN_JOB = "gpt3_mcore_tp2_pp1_cp4_dcp"  # ./scripts/run.sh


@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name):
    result = assert_recipe_passes(name)
    if name == MAIN_JOB:  # the main job visibly learns its Markov corpus
        loss = result.loss
        assert loss[1] > 4.5 and loss[max(loss)] < 2.0, loss


def test_every_recipe_is_tested():
    from megatron_hcp.functional.recipe import list_recipes
    from tests.functional.test_recipes_static_cp import RECIPES as STATIC

    assert sorted([*STATIC, *RECIPES, HCP_RECIPE]) == list_recipes()


def test_dynamic_hcp_recipe_runs_hierarchical_groups():
    """The dynamic HCP recipe really switches levels: some micro-batches run 8-rank groups
    (a2a 2 x p2p 4), and hierarchical groups run in every step; it equals golden and CP=1."""
    from megatron_hcp.functional.harness import check_recipe
    from tests.functional._check import CP1_RUNS

    result = check_recipe(HCP_RECIPE, echo=None, cp1_cache=CP1_RUNS)
    assert result.passed, "\n".join(result.lines)
    largest, hierarchical = (result.metrics["max-cp-group-size"],
                             result.metrics["hierarchical-cp-groups"])
    assert max(largest.values()) == 8, largest
    assert all(n >= 1 for n in hierarchical.values()), hierarchical
