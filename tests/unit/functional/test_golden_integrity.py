"""Golden values cannot be lost or pass by accident: NaN/inf fail, every step is required,
malformed files are refused before training, update-golden refuses bad runs and writes
atomically."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from megatron_hcp.functional.golden import (
    GoldenError,
    compare,
    load_golden,
    replace_golden,
    to_golden,
)
from megatron_hcp.functional.harness import check_recipe, max_rel_deviation
from megatron_hcp.functional.recipe import RECIPES_DIR

NAN = float("nan")


def metrics(losses, zeros=None):
    steps = range(1, len(losses) + 1)
    zeros = zeros or [10.0] * len(losses)
    return {"lm loss": dict(zip(steps, losses)), "num-zeros": dict(zip(steps, zeros)),
            "iteration-time": dict.fromkeys(steps, 1.0),
            "mem-allocated-bytes": dict.fromkeys(steps, 1e9)}


GOOD = [4.0, 3.9, 3.8, 3.7, 3.6, 3.5]


def test_a_run_shorter_than_the_golden_values_fails():
    result = compare(metrics(GOOD[:3]), to_golden(metrics(GOOD)))
    assert not result.passed
    assert any("no value for golden steps [4, 5, 6]" in line for line in result.lines)


def test_nan_in_one_step_of_a_run_fails():
    losses = [4.0 - 0.01 * i for i in range(40)]
    run = list(losses)
    run[7] = NAN  # 1 of 40 steps would pass the 95 % rule if NaN counted as a pass
    assert not compare(metrics(run), to_golden(metrics(losses))).passed


@pytest.mark.parametrize("edit, fragment", [
    (lambda g: g["lm loss"]["values"].pop("6"), "missing [6]"),
    (lambda g: g["lm loss"]["values"].__setitem__("3", None), "step 3"),
    (lambda g: g["num-zeros"].__setitem__("end_step", "6"), "end_step"),
    (lambda g: g.pop("num-zeros"), "'num-zeros' is missing"),
])
def test_malformed_golden_files_are_refused(tmp_path, edit, fragment):
    golden = to_golden(metrics(GOOD))
    edit(golden)
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(golden))
    with pytest.raises(GoldenError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_golden(path)


def test_nan_in_a_golden_file_is_not_json(tmp_path):
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(to_golden(metrics([4.0, NAN, 3.0]))))  # json writes NaN
    with pytest.raises(GoldenError, match="NaN"):
        load_golden(path)


@pytest.mark.parametrize("run, reference", [
    ({1: 1.0, 2: NAN}, {1: 1.0, 2: NAN}),
    ({1: 1.0, 2: 2.0}, {1: 1.0, 2: math.inf}),
    ({1: 1.0}, {1: 1.0, 2: 2.0}),
])
def test_nan_or_missing_steps_never_pass_the_invariance_checks(run, reference):
    assert max_rel_deviation(run, reference, range(1, 3)) == math.inf
    assert max_rel_deviation({1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0}, range(1, 3)) == 0.0


@pytest.mark.parametrize("run, fragment", [
    (metrics([4.0, 3.9, NAN]), "diverged"),
    (metrics([4.0, math.inf, 3.0, 2.0, 1.0, 0.5]), "diverged"),
    (metrics(GOOD[:3]), "shorter"),
])
def test_update_golden_refuses_a_bad_run_and_keeps_the_file(tmp_path, run, fragment):
    path = tmp_path / "golden_values_dev_cpu_gloo.json"
    path.write_text(json.dumps(to_golden(metrics(GOOD)), indent=2))
    before = path.read_bytes()
    with pytest.raises(GoldenError, match=fragment):
        replace_golden(path, run, steps=6)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_update_golden_writes_standard_json_and_reports_each_step(tmp_path):
    path = tmp_path / "golden_values_dev_cpu_gloo.json"
    path.write_text(json.dumps(to_golden(metrics(GOOD))))
    new = list(GOOD)
    new[2] = 3.81
    lines = replace_golden(path, metrics(new), steps=6, label="r")
    assert "r: lm loss step 3: 3.8 -> 3.81 (relative change 2.632e-03)" in lines
    assert "r: lm loss: 1 of 6 steps changed" in lines
    assert load_golden(path)["lm loss"]["values"]["3"] == 3.81


def test_a_malformed_golden_file_is_refused_before_training(tmp_path):
    recipe = tmp_path / "gpt3_mcore_tp1_pp1_cp4_p2p"
    shutil.copytree(RECIPES_DIR / "gpt3_mcore_tp1_pp1_cp4_p2p", recipe)
    golden = recipe / "golden_values_dev_cpu_gloo.json"
    golden.write_text(golden.read_text()[:200])  # truncated
    with pytest.raises(GoldenError, match="cannot read golden values"):
        check_recipe(str(recipe), echo=None)


def test_a_killed_writer_leaves_no_stray_temporary_file_for_the_next_run(tmp_path):
    """A writer killed between its temporary file and the rename (here: a forked child ended
    by os._exit at that point) leaves ``golden_values*.json.<pid>.*.tmp``; the next update
    removes it, and keeps the temporary file of a writer that is still running."""
    import os

    from megatron_hcp.files.atomic_write import write_atomic

    path = tmp_path / "golden_values_dev_cpu_gloo.json"
    path.write_text(json.dumps(to_golden(metrics(GOOD))))

    def crash_before_rename(what: str) -> None:
        if what.startswith("rename"):
            os._exit(9)

    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        write_atomic(path, "{half of a new golden file", on_step=crash_before_rename)
        os._exit(0)
    os.waitpid(pid, 0)
    strays = sorted(tmp_path.glob("golden_values_dev_cpu_gloo.json.*.tmp"))
    assert [p.name.split(".")[2] for p in strays] == [str(pid)]
    live = tmp_path / f"golden_values_dev_cpu_gloo.json.{os.getpid()}.abc123.tmp"
    live.write_text("a writer at work")
    replace_golden(path, metrics(GOOD), steps=6, label="r")
    assert sorted(tmp_path.glob("*.tmp")) == [live]
    assert load_golden(path)["lm loss"]["values"]["1"] == 4.0
