"""One strict value parser everywhere (config pairs, recipe loader, CLI, schedule input) and a
command line that answers any input with exit 0 or 2, one line, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hcp import cli
from megatron_hcp.config import CPConfig, CPConfigError, parse_value
from megatron_hcp.functional.golden import GoldenError, load_golden
from megatron_hcp.functional.harness import recipe_dir
from megatron_hcp.functional.recipe import load_recipe

DYNAMIC = ["context_parallel_size=2", "data_parallel_size=2", "max_seqlen_per_dp_cp_rank=512"]


def violated(err: CPConfigError) -> set[str]:
    return {v.parameter for v in err.violations}


@pytest.mark.parametrize("pairs, parameter", [
    (["dynamic_context_parallel=no"], "dynamic_context_parallel"),
    (["dynamic_context_parallel=yes"], "dynamic_context_parallel"),
    (["te_version=banana9"], "te_version"),
    (["context_parallel_size=four"], "context_parallel_size"),
    (["context_parallel_size=2.0"], "context_parallel_size"),
    (["seq_length=true"], "seq_length"),
    (["hierarchical_context_parallel_sizes=[2,x]"], "hierarchical_context_parallel_sizes[1]"),
    (["context_parallel_size=100000000"], "context_parallel_size"),
    ([*DYNAMIC, "dynamic_context_parallel=true", "calculate_per_token_loss=0"],
     "calculate_per_token_loss"),
])
def test_config_pairs_are_read_strictly(pairs, parameter):
    with pytest.raises(CPConfigError) as info:
        CPConfig.from_pairs(pairs).validate()
    assert parameter in violated(info.value), info.value


def test_boolean_spellings_and_versions_that_are_accepted():
    config = CPConfig.from_pairs([*DYNAMIC, "dynamic_context_parallel=1", "te_version=1.13.0+cu12",
                                  "calculate_per_token_loss=TRUE"])
    assert config.dynamic_context_parallel is True and config.calculate_per_token_loss is True
    assert config.te_version == "1.13.0+cu12"
    assert parse_value("0", "bool", "x") is False


@pytest.mark.parametrize("kwargs, parameter", [
    ({"dynamic_context_parallel": "no"}, "dynamic_context_parallel"),
    ({"calculate_per_token_loss": 0}, "calculate_per_token_loss"),
    ({"te_version": "banana9"}, "te_version"),
])
def test_validate_refuses_loosely_typed_fields(kwargs, parameter):
    with pytest.raises(CPConfigError) as info:
        CPConfig(**kwargs).validate()
    assert parameter in violated(info.value)


def write_recipe(tmp_path, args_yaml: str, nproc: str = "4"):
    (tmp_path / "model_config.yaml").write_text(
        f"ENV_VARS: {{}}\nNPROC: {nproc}\nTEST_TYPE: regular\nMODEL_ARGS:\n{args_yaml}")
    return tmp_path


@pytest.mark.parametrize("args_yaml, nproc, parameter", [
    ("  --seq-length: 2.7\n", "4", "--seq-length"),
    ("  --context-parallel-size: true\n", "4", "--context-parallel-size"),
    ('  --mock-data: "no"\n', "4", "--mock-data"),
    ("  --num-layers: 2\n", "2.5", "NPROC"),
])
def test_recipe_loader_does_not_coerce(tmp_path, args_yaml, nproc, parameter):
    with pytest.raises(CPConfigError) as info:
        load_recipe(write_recipe(tmp_path, args_yaml, nproc))
    assert parameter in violated(info.value), info.value


def test_recipe_with_a_python_tag_is_a_config_error(tmp_path):
    (tmp_path / "model_config.yaml").write_text(
        "NPROC: !!python/object/apply:os.getcwd []\nMODEL_ARGS: {}\n")
    with pytest.raises(CPConfigError, match="not plain YAML"):
        load_recipe(tmp_path)


def run_cli(argv, capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("content", ['[100.7, 200]', '[100, "200"]', '[100, true]', '[null]',
                                     '[1e400]', '{"a": 1}', 'not json', '[0]'])
def test_schedule_input_is_not_coerced(tmp_path, capsys, content):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(content)
    code, err = run_cli(["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "512",
                         "--lengths", str(lengths)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--lengths" in err


@pytest.mark.parametrize("argv", [
    ["verify-groups", "--tp", "0"],
    ["verify-groups", "--hcp", "a,b"],
    ["verify-groups", "--world-size", "10"],
    ["verify-groups", "--world-size", "100000"],
    ["layout", "--world-size", "100000000"],
    ["layout", "--world-size", "8", "--order", "tp-xx"],
    ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "512", "--heads", "0",
     "--lengths", "x.json"],
    ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "512", "--link-gbps", "0",
     "--lengths", "x.json"],
    ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "512", "--tflops", "nan",
     "--lengths", "x.json"],
    ["functional", "run", "no-such-recipe"],
    ["functional", "run", "gpt3_mcore_tp1_pp1_cp4_p2p", "--steps", "0"],
    ["patch", "check", "--target", "/no/such/dir"],
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv):
    """These started processes or ended in a traceback before; now one line, exit 2, and
    nothing started (parse_and_check refuses them first)."""
    assert cli.parse_and_check(argv) == 2
    capsys.readouterr()
    code, err = run_cli(argv, capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------- bounds, named, before any work
DEEP = "[" * 100000 + "]" * 100000
MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4"]
SCHEDULE = ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "512"]


@pytest.mark.parametrize("argv, fragment", [
    (["plan", *MODEL, "--seq-length", "64", "--global-batch", "8", "--nodes", "1000000000"],
     "--nodes=1000000000 must be <= 131072"),
    (["plan", *MODEL, "--seq-length", "64", "--global-batch", "8", "--nodes", "4096"],
     "over the planner's limit of 16384"),
    (["plan", *MODEL, "--lognormal", "100,1,2.7,10.9", "--global-batch", "8"],
     "--lognormal MIN='2.7': must be an integer"),
    (["plan", *MODEL, "--lognormal", "100,1,2,10.9", "--global-batch", "8"],
     "--lognormal MAX='10.9': must be an integer"),
    (["plan", *MODEL, "--seq-length", "64", "--global-batch", "8", "--plot",
      "/nonexistent/dir/x.png"], "the directory '/nonexistent/dir' does not exist"),
    (["plan", *MODEL, "--seq-length", str(10 ** 400), "--global-batch", "8"],
     "must be within +-9223372036854775807 (int64); it has 401 digits"),
    (["plan", *MODEL, "--seq-length", "64", "--global-batch", "8", "--tflops", "1e400"],
     "--tflops=inf must be a finite number"),
    (["plan", *MODEL, "--lengths", "deep.json"], "deeper than the limit of 64"),
    (["plan", *MODEL, "--lengths", "huge.json"], "outside the limit of +-9223372036854775807"),
    (["plan", "--model", "deep.yaml", "--seq-length", "64", "--global-batch", "8"],
     "deeper than the limit of 64"),
    ([*SCHEDULE, "--heads", "3", "--kv-heads", "5", "--lengths", "L.json"],
     "--kv-heads 5 must divide --heads 3"),
    ([*SCHEDULE, "--lengths", "deep.json"], "deeper than the limit of 64"),
    ([*SCHEDULE, "--lengths", "huge.json"], "outside the limit of +-9223372036854775807"),
    ([*SCHEDULE, "--lengths", "/dev/zero"], "is a character device, not a regular file"),
    ([*SCHEDULE, "--lengths", "L.json", "--plot", "/nonexistent/dir/x.png"],
     "the directory '/nonexistent/dir' does not exist"),
    ([*SCHEDULE, "--lengths", "L.json", "--plot", "L.json/x.png"],
     "'L.json' is not a directory"),
    ([*SCHEDULE, "--lengths", "L.json", "--plot", "out.exe"], "unknown file type '.exe'"),
    (["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", str(10 ** 12), "--lengths",
      "L.json"], "must be <= 67108864"),
    (["functional", "run", "gpt3_mcore_tp1_pp1_cp4_p2p", "--plot", "L.json/plots"],
     "is not a directory"),
    (["functional", "run", "recipe-deep"], "deeper than the limit of 64"),
    (["functional", "run", "recipe-long"], "--train-iters=1000000000: must be <= 100000"),
    (["functional", "run", "recipe-bad-golden"], "end_step=1000000000 is over the limit"),
    (["patch", "apply", "--target", ".", "--lock-timeout", "1e9"], "must be <= 3600"),
])
def test_inputs_beyond_their_limits_are_refused_before_any_work(in_tmp, capsys, argv,
                                                                 fragment):
    """Each of these hung, ran out of memory, overflowed, recursed or failed only after the
    work; now the input check (parse_and_check: nothing has started) refuses it in one line
    that names the limit."""
    assert cli.parse_and_check(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_golden_files_beyond_their_limits_are_named_errors(tmp_path):
    block = {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 1.0, "2": 1.0}}
    for text, fragment in [
        (json.dumps({"lm loss": {**block, "end_step": 10 ** 9}, "num-zeros": block}),
         "end_step=1000000000 is over the limit of 100000 steps"),
        (json.dumps({"lm loss": {**block, "values": {"1": 10 ** 400, "2": 1.0}},
                     "num-zeros": block}), "outside the limit of +-9223372036854775807"),
        (DEEP, "deeper than the limit of 64"),
    ]:
        (tmp_path / "g.json").write_text(text)
        with pytest.raises(GoldenError, match=fragment.replace("+", r"\+")):
            load_golden(tmp_path / "g.json")


@pytest.mark.parametrize("args_yaml, fragment", [
    ("  --train-iters: 1000000000\n", "--train-iters=1000000000: must be <= 100000"),
    ("  --hidden-size: 1000000000\n", "--hidden-size=1000000000: must be <= 1048576"),
    (f"  --seq-length: {10 ** 400}\n", "outside the limit of +-9223372036854775807"),
    ("  --mock-max-seqlen: 100000000000\n", "must be <= 67108864"),
    ("  --num-layers: 100000\n", "--num-layers=100000: must be <= 4096"),
])
def test_recipe_values_beyond_their_limits_are_refused(tmp_path, args_yaml, fragment):
    with pytest.raises(CPConfigError, match=fragment.replace("+", r"\+")):
        load_recipe(write_recipe(tmp_path, args_yaml))


# --------------------------------------------------------------- property: any string, any arg
TEXT = st.one_of(st.text(max_size=12), st.integers(-3, 300).map(str), st.sampled_from(
    ["2,2", "[2,4]", "4,1", "nan", "inf", "1e400", "0.5", "true", "tp-cp-ep-pp-dp", "flops",
     "L.json", "/", ".", "1000000000", str(10 ** 400), "-" + str(10 ** 30), "100,1,2.7,10.9",
     "8,1.2,16,64", "deep.json", "huge.json", "deep.yaml", "/dev/zero", "/nonexistent/d/x.png",
     "L.json/x.png", "recipe-deep", "recipe-long", "recipe-bad-golden"]))
# every command with every option; commands that start ranks or write files (verify-groups,
# functional run/compare/update-golden, patch apply/revert) only go through parse_and_check
RUNS = {
    "layout": ["--world-size", "--tp", "--cp", "--pp", "--ep", "--hcp", "--order"],
    "schedule": ["--dp-cp", "--max-seqlen-per-rank", "--min-cp-size", "--vpp", "--cost",
                 "--hidden", "--layers", "--heads", "--kv-heads", "--ffn", "--link-gbps",
                 "--link-latency-us", "--tflops", "--lengths", "--gpus-per-node",
                 "--intra-gbps", "--inter-gbps", "--intra-latency-us", "--inter-latency-us",
                 "--hcp"],
    "patch check": ["--target", "--lock-timeout"],
}
LAUNCH = ["--nnodes", "--node-rank", "--master-addr", "--master-port", "--platform"]
CHECKS_ONLY = {
    "verify-groups": ["--world-size", "--tp", "--cp", "--pp", "--hcp", "--cp-comm-type",
                      "--order"],
    "functional run": ["--steps", "--allow-env", *LAUNCH, "--plot"],
    "functional compare": ["--steps", "--allow-env", *LAUNCH, "--plot"],
    "functional update-golden": ["--allow-env", *LAUNCH],
    "patch apply": ["--target", "--lock-timeout"],
    "patch revert": ["--target", "--lock-timeout"],
    # plan runs for seconds to minutes on valid inputs: its input checks are what is tested
    "plan": ["--model", "--layers", "--hidden", "--ffn", "--heads", "--kv-heads", "--head-dim",
             "--vocab", "--seq-length", "--lengths", "--lognormal", "--global-batch", "--seed",
             "--nodes", "--gpus-per-node", "--intra-gbps", "--inter-gbps", "--intra-latency-us",
             "--inter-latency-us", "--tflops", "--gpu-memory-gb", "--recompute", "--te-version",
             "--tie-tolerance", "--max-tp", "--top", "--plot"],
}
REQUIRED = {"layout": ["--world-size", "8"],
            "schedule": ["--dp-cp", "4", "--max-seqlen-per-rank", "64", "--lengths", "L.json"],
            "plan": ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-length", "64",
                     "--global-batch", "8"]}


def argv_for(command: str, options: list[str], data) -> list[str]:
    argv = command.split() + REQUIRED.get(command, [])
    for option in data.draw(st.lists(st.sampled_from(options), max_size=5, unique=True)
                            ) if options else []:
        argv += [option, data.draw(TEXT)]
    if command.startswith("functional"):
        argv.insert(2, data.draw(TEXT))
    if command == "check-config":
        argv += [f"{k}={data.draw(TEXT)}" for k in data.draw(
            st.lists(st.sampled_from(CPConfig.field_names()), max_size=4))]
    return argv


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "L.json").write_text(json.dumps([100, 300, 40, 64]))
    (tmp_path / "deep.json").write_text(DEEP)
    (tmp_path / "deep.yaml").write_text(DEEP)
    (tmp_path / "huge.json").write_text(f"[{10 ** 400}]")
    shipped = recipe_dir("gpt3_mcore_tp1_pp1_cp4_p2p")
    for name, edit in (("recipe-deep", lambda text: DEEP),
                       ("recipe-long", lambda text: text.replace("--train-iters: 6",
                                                                 "--train-iters: 1000000000")),
                       ("recipe-bad-golden", None)):
        shutil.copytree(shipped, tmp_path / name)
        config = tmp_path / name / "model_config.yaml"
        if edit is not None:
            config.write_text(edit(config.read_text()))
        else:
            golden = tmp_path / name / "golden_values_dev_cpu_gloo.json"
            data = json.loads(golden.read_text())
            data["lm loss"]["end_step"] = 10 ** 9
            golden.write_text(json.dumps(data))
    return tmp_path


@settings(max_examples=300, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_argument_string_exits_0_or_2_without_traceback(in_tmp, capsys, data):
    command = data.draw(st.sampled_from([*RUNS, *CHECKS_ONLY, "check-config"]))
    argv = argv_for(command, RUNS.get(command) or CHECKS_ONLY.get(command) or [], data)
    if command in CHECKS_ONLY:
        result = cli.parse_and_check(argv)
        code = result if isinstance(result, int) else 0
    else:
        code = cli.main(argv)
    out = capsys.readouterr()
    assert code in (0, 2), (argv, out.err)
    assert "Traceback" not in out.err + out.out, argv
    if code == 2 and command != "check-config":
        assert len(out.err.strip().splitlines()) == 1, (argv, out.err)


# --------------------------------------------------------------- property: any file, any input
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4), max_leaves=12)
CONTENT = st.one_of(
    JSONISH.map(json.dumps),
    st.lists(st.integers(-5, 10 ** 30), max_size=6).map(json.dumps),
    st.integers(1, 150000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 150000).map(lambda n: "{\"a\": " * n),
    st.integers(1, 5000).map(lambda n: "".join(" " * i + "- \n" for i in range(n))),
    st.sampled_from([f"[{10 ** 400}]", "[1e400]", "[NaN]", "", "{}", "[]", "- a\n  - b",
                     "a: &x [1]\nb: *x", "NPROC: !!python/object/apply:os.getcwd []",
                     "MODEL_ARGS: {--num-layers: 2}", "--num-layers 2 --hidden-size x",
                     "'unterminated"]),
    st.text(max_size=64),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)
# every file a command reads, and how the test passes it (through the input checks only:
# nothing that would train or plan at length runs)
FILE_INPUTS = {
    "schedule --lengths": lambda f: ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "64",
                                     "--lengths", f],
    "plan --lengths": lambda f: ["plan", *MODEL, "--lengths", f],
    "plan --model": lambda f: ["plan", "--model", f, "--seq-length", "64", "--global-batch",
                               "8"],
    "recipe model_config.yaml": lambda f: ["functional", "run", "recipe"],
    "recipe golden values": lambda f: ["functional", "run", "recipe"],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_file_content_exits_0_or_2_without_traceback(in_tmp, capsys, data):
    """Random, deep, huge or malformed content in every file input: one line, exit 2 (or a
    valid file: exit 0), never a traceback, RecursionError, OverflowError or MemoryError."""
    which = data.draw(st.sampled_from(sorted(FILE_INPUTS)))
    content = data.draw(CONTENT)
    shutil.rmtree(in_tmp / "recipe", ignore_errors=True)
    shutil.copytree(recipe_dir("gpt3_mcore_tp1_pp1_cp4_p2p"), in_tmp / "recipe")
    target = {"recipe model_config.yaml": in_tmp / "recipe" / "model_config.yaml",
              "recipe golden values": in_tmp / "recipe" / "golden_values_dev_cpu_gloo.json",
              }.get(which, in_tmp / "input.file")
    target.write_bytes(content.encode("utf-8", "surrogatepass"))
    argv = FILE_INPUTS[which](str(target))
    if argv[0] == "schedule":
        code = cli.main(argv)
    else:
        result = cli.parse_and_check(argv)
        code = result if isinstance(result, int) else 0
    out = capsys.readouterr()
    assert code in (0, 2), (which, content[:80], out.err)
    assert "Traceback" not in out.err + out.out, which
    if code == 2:
        assert len(out.err.strip().splitlines()) == 1, (which, content[:80], out.err)


@pytest.mark.parametrize("argv", [
    ["functional", "run", "no-such-recipe"],
    ["functional", "update-golden", "no-such-recipe"],
    ["plan", "--layers", "x"],
    ["patch", "apply", "--target", "/no/such/dir"],
    ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "64", "--lengths", "/no/such.json"],
])
@pytest.mark.multirank
def test_a_bad_input_in_a_fresh_process_is_one_line_without_import_warnings(argv):
    """A fresh interpreter with Python's warnings on: nothing (no megatron import warning)
    before the one-line error."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "megatron_hcp.cli", *argv],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
