"""One ``update-golden`` of a golden file at a time: the lock beside it (``<file>.lock``, flock)
is taken before training, a second run is refused at once with one line naming the file and
the holder's pid, and the lock goes when the first run ends, however it ends. (Two real
processes: tests/unit/functional/test_run_end.py.)"""

from __future__ import annotations

import os
import shutil

import pytest

from megatron_hcp import cli
from megatron_hcp.functional import harness
from megatron_hcp.functional.golden import GoldenError, golden_lock, load_golden
from megatron_hcp.functional.recipe import RECIPES_DIR, load_recipe

RECIPE = "gpt3_mcore_tp1_pp1_cp4_p2p"


@pytest.fixture
def recipe(tmp_path):
    folder = tmp_path / RECIPE
    shutil.copytree(RECIPES_DIR / RECIPE, folder)
    return load_recipe(folder)


def _finished_run(recipe, **kwargs):
    steps = range(1, recipe.steps + 1)
    return {name: {s: 5.0 + s / 100 for s in steps}
            for name in ("lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")}


def _no_training(*args, **kwargs):
    raise AssertionError("trained although another update holds the lock")


def test_a_second_update_is_refused_before_training(recipe, monkeypatch, capsys):
    golden = recipe.golden_path(platform="cpu_gloo")
    before = golden.read_bytes()
    monkeypatch.setattr(harness, "run_recipe", _no_training)
    with golden_lock(golden) as lock:  # the first update, training
        assert lock == golden.with_name(golden.name + ".lock")
        assert lock.read_text() == f"{os.getpid()}\n"
        with pytest.raises(GoldenError) as info:
            harness.update_golden(recipe, echo=None)
        assert str(info.value) == (
            f"golden values {golden}: another update-golden run (pid {os.getpid()}) holds its "
            f"lock {lock}; wait for it to finish, or end it, and run again")
        # the command line: one line, exit 1
        assert cli.main(["functional", "update-golden", str(recipe.path),
                         "--platform", "cpu_gloo"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [str(info.value)]
    assert golden.read_bytes() == before
    assert not lock.exists()  # released and removed


def test_the_lock_is_held_through_training_and_released_however_it_ends(recipe, monkeypatch):
    golden = recipe.golden_path(platform="cpu_gloo")
    seen = []

    def training(recipe, **kwargs):  # a second update while this one trains is refused
        with pytest.raises(GoldenError, match=f"pid {os.getpid()}"):
            with golden_lock(golden):
                pass
        seen.append(True)
        return _finished_run(recipe)

    monkeypatch.setattr(harness, "run_recipe", training)
    lines = harness.update_golden(recipe, echo=None)
    assert seen and any("lm loss: 6 of 6 steps changed" in line for line in lines), lines
    assert load_golden(golden)["lm loss"]["values"]["1"] == 5.01
    assert not golden.with_name(golden.name + ".lock").exists()

    def fails(recipe, **kwargs):
        raise harness.RecipeRunError("a rank failed")

    monkeypatch.setattr(harness, "run_recipe", fails)
    with pytest.raises(harness.RecipeRunError):
        harness.update_golden(recipe, echo=None)
    monkeypatch.setattr(harness, "run_recipe", _finished_run)
    assert harness.update_golden(recipe, echo=None)  # the lock was released
    assert sorted(p.name for p in recipe.path.iterdir()) == sorted(
        p.name for p in (RECIPES_DIR / RECIPE).iterdir())


def test_a_lock_file_left_by_a_killed_run_does_not_block(recipe):
    golden = recipe.golden_path(platform="cpu_gloo")
    stale = golden.with_name(golden.name + ".lock")
    stale.write_text("999999999\n")  # its holder is gone: flock held by nobody
    with golden_lock(golden) as lock:
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not stale.exists()
