"""Functional recipes of test type ckpt-resume: train, save at the midpoint, resume; the losses
after resuming equal the uninterrupted run, which equals its golden values and CP=1."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

RECIPES = ["gpt3_mcore_tp2_pp1_cp2_ckpt_resume", "gpt3_mcore_tp1_pp2_cp4_a2a_p2p"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name, tmp_path):
    # each also draws its plot (run, golden, CP=1, resumed run, resume point)
    assert_recipe_passes(name, tmp_path)
