"""Functional recipes, static CP: golden values and CP=1 invariance (one CP=1 run serves the
three, which share model, data and layout)."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

RECIPES = ["gpt3_mcore_tp1_pp1_cp4_p2p", "gpt3_mcore_tp1_pp1_cp4_all_gather",
           "gpt3_mcore_tp1_pp1_cp4_a2a"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name):
    assert_recipe_passes(name)
