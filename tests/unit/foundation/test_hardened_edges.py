"""Hardened edges (issue 35): every case a hostile or careless input found, as a regression test -
the input, exit 2 or the named error, one line, nothing written, nothing started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_hcp import cli
from megatron_hcp.config import FIELD_KINDS, CPConfig, CPConfigError
from megatron_hcp.functional.golden import GoldenError, compare, load_golden, to_golden
from megatron_hcp.functional.harness import recipe_dir
from tests.unit.config.test_strict_inputs import FILE_INPUTS

ROOT = Path(__file__).resolve().parents[3]
RECIPE = "gpt3_mcore_tp1_pp1_cp4_p2p"
MODEL = ["--layers", "2", "--hidden", "256", "--heads", "4"]


def named(err: CPConfigError) -> set[str]:
    return {v.parameter for v in err.violations}


@contextmanager
def at_most(seconds: int):
    """Fail instead of hanging (a FIFO that blocks the reader would hang the suite)."""
    def stop(*_):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """``megatron-hcp ARGV`` through its input checks (nothing trains or plans at length)."""
    with at_most(60):
        result = cli.parse_and_check(argv)
    code = result if isinstance(result, int) else 0
    return code, capsys.readouterr().err


# ------------------------------------------------------------------ 1. the Python API's types
@pytest.mark.parametrize("kwargs, parameters", [
    ({"context_parallel_size": "4", "seq_length": 4096}, {"context_parallel_size"}),
    ({"context_parallel_size": None, "dynamic_context_parallel": True,
      "max_seqlen_per_dp_cp_rank": 64}, {"context_parallel_size"}),
    ({"cp_comm_type": 5}, {"cp_comm_type"}),
    ({"hierarchical_context_parallel_sizes": ["x", "y"], "dynamic_context_parallel": True,
      "context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "max_seqlen_per_dp_cp_rank": 64},
     {"hierarchical_context_parallel_sizes"}),
    ({"context_parallel_size": "4", "tensor_model_parallel_size": 2.0, "num_layers": "x",
      "dynamic_context_parallel": "yes", "window_size": (1, 2, 3)},
     {"context_parallel_size", "tensor_model_parallel_size", "num_layers",
      "dynamic_context_parallel", "window_size"}),
])
def test_the_api_names_every_mistyped_field_at_once(kwargs, parameters):
    with pytest.raises(CPConfigError) as info:
        CPConfig(**kwargs).validate()
    assert parameters <= named(info.value), info.value


def test_numpy_integers_are_integers():
    config = CPConfig(context_parallel_size=np.int64(2), hierarchical_context_parallel_sizes=[
        np.int32(1), np.int64(2)], cp_comm_type="a2a+p2p")
    config.validate()
    assert type(config.context_parallel_size) is int
    assert [type(x) for x in config.hierarchical_context_parallel_sizes] == [int, int]


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10 ** 30), st.floats(),
                   st.text(max_size=6), st.sampled_from(["4", "a2a+p2p", "p2p", " 2 "]),
                   st.lists(st.one_of(st.integers(-2, 9), st.text(max_size=3)), max_size=3),
                   st.tuples(st.integers(-2, 9), st.integers(-2, 9)),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                   st.sampled_from([np.int64(2), np.float32(2.0), b"4", object()]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(sorted(FIELD_KINDS)), VALUES, max_size=4))
# found by this test on 2026-11-29 at 048f796: "¹".isdigit() is True, int("¹") raises
@example(fields={"calculate_per_token_loss": "\u00b9"})
@example(fields={"context_parallel_size": "\u0664"})  # an Arabic-Indic 4: int() reads it
def test_any_field_values_give_a_config_error_or_a_valid_config(fields):
    """Whatever Python values the fields hold: validate() passes or raises CPConfigError naming
    fields - never a TypeError or any other exception."""
    try:
        CPConfig(**fields).validate()
    except CPConfigError as err:
        assert err.violations and all(str(v) for v in err.violations)


def test_errors_quote_only_a_prefix_of_a_huge_value():
    with pytest.raises(CPConfigError) as info:
        CPConfig(num_layers="x" * 4_000_000).validate()
    assert len(str(info.value)) < 400


# ------------------------------------------------------------------ 3. inputs that hang or flood
@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _special(kind: str, where: Path) -> str:
    """A path that is no regular file: a FIFO nobody writes, a directory, a device, a loop."""
    path = where / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "loop":
        os.symlink(where / "loop-b", path)
        os.symlink(path, where / "loop-b")
    else:
        return "/dev/zero"
    return str(path)


FILE_READERS = {k: FILE_INPUTS[k] for k in ("schedule --lengths", "plan --lengths",
                                            "plan --model")}


@pytest.mark.parametrize("kind", ["fifo", "dir", "device", "loop"])
@pytest.mark.parametrize("reader", sorted(FILE_READERS))
def test_file_inputs_refuse_what_is_no_regular_file_without_blocking(in_tmp, capsys, reader,
                                                                       kind):
    code, err = run_cli(capsys, FILE_READERS[reader](_special(kind, in_tmp)))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not a regular file" in err or "cannot be read" in err, err


def _recipe(in_tmp: Path) -> Path:
    import shutil

    target = in_tmp / "recipe"
    shutil.copytree(recipe_dir(RECIPE), target)
    return target


@pytest.mark.parametrize("kind", ["fifo", "dir", "loop"])
@pytest.mark.parametrize("command", ["run", "compare", "update-golden"])
def test_a_golden_file_that_is_no_file_is_refused_before_any_rank(in_tmp, capsys, kind,
                                                                   command):
    recipe = _recipe(in_tmp)
    golden = recipe / "golden_values_dev_cpu_gloo.json"
    golden.unlink()
    special = Path(_special(kind, in_tmp))
    os.rename(special, golden) if kind != "loop" else os.symlink(special, golden)
    code, err = run_cli(capsys, ["functional", command, str(recipe), "--platform", "cpu_gloo"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def _alias_bomb(levels: int = 8, fan: int = 9) -> str:
    """``fan ** levels`` leaves from ``fan * levels`` aliases (63 aliases for 9^8 at 7 levels
    of aliases): within the alias limit, beyond any sane size once expanded."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * fan) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_fast_with_a_short_error(in_tmp, capsys):
    recipe = _recipe(in_tmp)
    text = (recipe / "model_config.yaml").read_text()
    (recipe / "model_config.yaml").write_text(text + "BOMB:\n" + "".join(
        "  " + line + "\n" for line in _alias_bomb().splitlines()))
    for command in ("run", "update-golden"):
        with at_most(20):
            code, err = run_cli(capsys, ["functional", command, str(recipe)])
        assert code == 2 and "expands to more than" in err and len(err) < 500, err[:500]


@pytest.mark.parametrize("content, parameter", [
    ('NPROC: "4"\n', "NPROC"),
    ('NPROC: 4\nMODEL_ARGS: {--num-layers: "32"}\n', "--num-layers"),
])
def test_quoted_numbers_in_a_recipe_are_text_not_numbers(in_tmp, capsys, content, parameter):
    recipe = in_tmp / "quoted"
    recipe.mkdir()
    (recipe / "model_config.yaml").write_text(content)
    for command in ("run", "update-golden"):
        code, err = run_cli(capsys, ["functional", command, str(recipe)])
        assert code == 2 and parameter in err and "not text" in err, err


@pytest.mark.parametrize("addr", ["", "no de", "n\u00f6de.example", "a" * 300, "-x"])
def test_a_master_address_that_is_no_host_is_refused(capsys, addr):
    code, err = run_cli(capsys, ["functional", "run", RECIPE, "--nnodes", "2", "--master-port",
                                 "29500", "--master-addr", addr])
    assert code == 2 and "--master-addr" in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ 4. numbers and paths
@pytest.mark.parametrize("argv", [
    ["check-config", "--context-parallel-size", "9" * 5000],
    ["check-config", "context_parallel_size=" + "9" * 5000, "seq_length=" + "1" * 5000],
])
def test_numbers_beyond_int64_are_refused_by_name(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "int64" in err and len(err) < 1000, err[:1000]


PLOT_COMMANDS = {
    "schedule": ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "64", "--lengths",
                 "lengths.json"],
    "plan": ["plan", *MODEL, "--nodes", "1", "--seq-length", "64", "--global-batch", "8"],
}


@pytest.mark.parametrize("plot", ["", "x", "x.png", "/dev/full", "fifo.png", "a" * 300])
@pytest.mark.parametrize("command", sorted(PLOT_COMMANDS))
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_work(in_tmp, capsys,
                                                                        command, plot):
    (in_tmp / "lengths.json").write_text(json.dumps([16, 32, 48, 64]))
    (in_tmp / "x.png").mkdir()  # "x" would be written as x.png: a directory
    os.mkfifo(in_tmp / "fifo.png")
    code, err = run_cli(capsys, [*PLOT_COMMANDS[command], "--plot", plot])
    assert code == 2 and "--plot" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["fifo.png", "lengths.json", "x.png"]


@pytest.mark.parametrize("command", sorted(PLOT_COMMANDS))
def test_a_plot_name_without_a_suffix_is_written_as_png_and_said(in_tmp, capsys, command):
    (in_tmp / "lengths.json").write_text(json.dumps([16, 32, 48, 64]))
    assert cli.main([*PLOT_COMMANDS[command], "--plot", "chart"]) == 0
    assert "plot: chart.png" in capsys.readouterr().out
    assert (in_tmp / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in in_tmp.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ 7. checks that must fail
def _metrics(steps: int) -> dict:
    return {name: {s: 1.0 + s for s in range(1, steps + 1)} for name in (
        "lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")}


def test_golden_values_of_fewer_steps_than_the_run_fail_the_check():
    golden = to_golden(_metrics(1))  # end_step 1, as if edited to match
    result = compare(_metrics(3), golden)
    assert not result.passed and any("FAIL" in line and "2, 3" in line
                                     for line in result.lines), result.lines


def test_a_repeated_key_in_a_golden_file_is_refused(tmp_path):
    block = json.dumps(to_golden(_metrics(2))["lm loss"])
    good = json.dumps(to_golden(_metrics(2)))
    path = tmp_path / "golden.json"
    path.write_text(good[:-1] + f', "lm loss": {block}}}')
    with pytest.raises(GoldenError, match="appears twice"):
        load_golden(path)


@pytest.mark.parametrize("content, message", [
    ("MODEL_ARGS: {--num-layers: '32', --hidden-size: 256, --num-attention-heads: 4}\n",
     "not text"),
    ("MODEL_ARGS: {--num-layers: 2, --hidden-size: 256, --num-attention-heads: 4, "
     "--swiglu: maybe}\n", "--swiglu"),
])
def test_plan_model_files_are_typed(in_tmp, capsys, content, message):
    (in_tmp / "model.yaml").write_text(content)
    code, err = run_cli(capsys, ["plan", "--model", "model.yaml", "--seq-length", "64",
                                 "--global-batch", "8"])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.multirank
def test_a_fifo_input_never_blocks_a_fresh_process(tmp_path):
    """The reported hang, end to end: ``schedule --lengths FIFO`` in a new process."""
    fifo = tmp_path / "lengths"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "megatron_hcp.cli", "schedule", "--dp-cp", "4",
                           "--max-seqlen-per-rank", "64", "--lengths", str(fifo)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 2 and "FIFO" in proc.stderr, proc.stderr
