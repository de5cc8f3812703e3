"""Functional recipe with every parallelism at once: TP2 + SP x PP2 x CP2 (upstream's
gpt3_mcore_te_tp2_pp2_cp2); golden values and CP=1 invariance."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

RECIPES = ["gpt3_mcore_tp2_pp2_cp2"]


def test_recipe():
    assert_recipe_passes(RECIPES[0])
