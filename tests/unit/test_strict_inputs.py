"""One strict value parser everywhere (config pairs, recipe loader, CLI, schedule input) and a
command line that answers any input with exit 0 or 2, one line, never a traceback."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hcp import cli
from megatron_hcp.config import CPConfig, CPConfigError, parse_value
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


# --------------------------------------------------------------- property: any string, any arg
TEXT = st.one_of(st.text(max_size=12), st.integers(-3, 300).map(str), st.sampled_from(
    ["2,2", "[2,4]", "4,1", "nan", "inf", "1e400", "0.5", "true", "tp-cp-ep-pp-dp", "flops",
     "L.json", "/", "."]))
# every command with every option; commands that start ranks or write files (verify-groups,
# functional run/compare/update-golden, patch apply/revert) only go through parse_and_check
RUNS = {
    "layout": ["--world-size", "--tp", "--cp", "--pp", "--ep", "--hcp", "--order"],
    "schedule": ["--dp-cp", "--max-seqlen-per-rank", "--min-cp-size", "--vpp", "--cost",
                 "--hidden", "--layers", "--heads", "--kv-heads", "--ffn", "--link-gbps",
                 "--link-latency-us", "--tflops", "--lengths", "--gpus-per-node",
                 "--intra-gbps", "--inter-gbps", "--intra-latency-us", "--inter-latency-us",
                 "--hcp"],
    "patch check": ["--target"],
}
LAUNCH = ["--nnodes", "--node-rank", "--master-addr", "--master-port", "--platform"]
CHECKS_ONLY = {
    "verify-groups": ["--world-size", "--tp", "--cp", "--pp", "--hcp", "--cp-comm-type",
                      "--order"],
    "functional run": ["--steps", "--allow-env", *LAUNCH, "--plot"],
    "functional compare": ["--steps", "--allow-env", *LAUNCH, "--plot"],
    "functional update-golden": ["--allow-env", *LAUNCH],
    "patch apply": ["--target"],
    "patch revert": ["--target"],
}
REQUIRED = {"layout": ["--world-size", "8"],
            "schedule": ["--dp-cp", "4", "--max-seqlen-per-rank", "64", "--lengths", "L.json"]}


def argv_for(command: str, options: list[str], data) -> list[str]:
    argv = command.split() + REQUIRED.get(command, [])
    for option in data.draw(st.lists(st.sampled_from(options), max_size=4, unique=True)
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
