"""Functional recipes, static CP / HCP and checkpoint resume: golden values and CP=1 invariance."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

RECIPES = ["gpt3_mcore_tp1_pp1_cp4_p2p", "gpt3_mcore_tp1_pp1_cp4_all_gather",
           "gpt3_mcore_tp1_pp1_cp4_a2a", "gpt3_mcore_tp2_pp1_cp2_ckpt_resume",
           "gpt3_mcore_tp1_pp2_cp4_a2a_p2p"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe(name, tmp_path):
    # the ckpt-resume recipe also draws its plot (run, golden, CP=1, resumed run, resume point)
    assert_recipe_passes(name, tmp_path if "ckpt_resume" in name else None)
