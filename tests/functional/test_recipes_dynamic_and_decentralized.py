"""Functional recipes: dynamic CP (TP, VPP) and decentralized HCP."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

RECIPES = ["gpt3_mcore_tp2_pp1_cp4_dcp", "gpt3_mcore_tp1_pp2_vpp2_cp2_dcp",
           "gpt3_mcore_tp2_pp1_cp4_a2a_p2p_decentralized_pg"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name):
    assert_recipe_passes(name)


def test_every_recipe_is_tested():
    from megatron_hcp.functional.recipe import list_recipes
    from tests.functional.test_recipes_static_cp import RECIPES as STATIC

    assert sorted(STATIC + RECIPES) == list_recipes()
