"""Functional recipe of the main job (``./scripts/run.sh``): dynamic CP with TP2 + SP, ckpt-resume,
a corpus the model learns. One module per recipe group, so that the test workers share the
recipes' minutes evenly."""

from __future__ import annotations

import pytest

from tests.functional._check import assert_recipe_passes

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

MAIN_JOB = "gpt3_mcore_tp2_pp1_cp4_dcp"
RECIPES = [MAIN_JOB]


def test_main_job_passes_and_learns():
    loss = assert_recipe_passes(MAIN_JOB).loss
    assert loss[1] > 4.5 and loss[max(loss)] < 2.0, loss  # it visibly learns its Markov corpus
