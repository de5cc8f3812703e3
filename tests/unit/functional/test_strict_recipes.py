"""A recipe file says exactly what runs, or is refused before any rank starts: unknown and
misspelt keys (named with the closest valid one), duplicate YAML keys, values out of range,
recipe functions outside the recipe modules, bad switch values in ENV_VARS or the launcher's
environment, and a model too large for the machine (the planner's memory model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hcp import cli
from megatron_hcp.config import CPConfigError
from megatron_hcp.functional.allowances import Allowed
from megatron_hcp.functional.bridge_recipe import _recipe_function, check_recipe_function
from megatron_hcp.functional.harness import recipe_dir
from megatron_hcp.functional.preflight import check_memory, recipe_memory
from megatron_hcp.functional.recipe import list_recipes, load_recipe
from megatron_hcp.functional.worker import worker_parser

BASE = (recipe_dir("gpt3_mcore_tp1_pp1_cp4_p2p") / "model_config.yaml").read_text()
GIB = 1 << 30


def recipe(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model_config.yaml").write_text(text)
    return tmp_path


def violations(path: Path, **kwargs) -> dict[str, CPConfigError]:
    with pytest.raises(CPConfigError) as info:
        load_recipe(path, **kwargs)
    return {v.parameter: v for v in info.value.violations}


def test_a_misspelt_section_is_refused_naming_the_closest_key(tmp_path):
    """MODEL_ARG instead of MODEL_ARGS loaded as the default model (CP 1, 3 steps)."""
    found = violations(recipe(tmp_path, BASE.replace("MODEL_ARGS:", "MODEL_ARG:")))
    assert "did you mean MODEL_ARGS?" in found["MODEL_ARG"].fix


@pytest.mark.parametrize("extra, key, hint", [
    ("FOO: 1\n", "FOO", "use one of"),
    ("nproc: 4\n", "nproc", "did you mean NPROC?"),
    ("TEST_TYPES: regular\n", "TEST_TYPES", "did you mean TEST_TYPE?"),
])
def test_unknown_top_level_keys_are_refused(tmp_path, extra, key, hint):
    found = violations(recipe(tmp_path, extra + BASE))
    assert key in found and hint in found[key].fix


def test_a_misspelt_flag_names_the_closest_flag(tmp_path):
    found = violations(recipe(tmp_path, BASE.replace("--num-layers:", "--num-layer:")))
    assert "did you mean --num-layers?" in found["--num-layer"].fix


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("  --num-layers: 4\n", "  --num-layers: 4\n  --num-layers: 2\n"),
    lambda t: t.replace("NPROC: 4\n", "NPROC: 4\nNPROC: 8\n"),
    lambda t: t.replace("ENV_VARS: {}", "ENV_VARS: {A: 1, A: 2}"),
])
def test_duplicate_yaml_keys_are_refused_with_both_lines(tmp_path, edit):
    with pytest.raises(CPConfigError) as info:
        load_recipe(recipe(tmp_path, edit(BASE)))
    text = str(info.value)
    assert "twice in one mapping" in text and "lines" in text


@pytest.mark.parametrize("flag, value", [
    ("--lr", "-1.0"), ("--lr", "0.0"), ("--lr", "1.0e+300"), ("--lr", "2.0"),
])
def test_learning_rates_out_of_range_are_refused(tmp_path, flag, value):
    found = violations(recipe(tmp_path, BASE.replace("--lr: 0.001", f"--lr: {value}")))
    assert flag in found


def test_variable_length_knobs_out_of_range_are_refused(tmp_path):
    varlen = BASE.replace("  --micro-batch-size: 1\n", "  --micro-batch-size: 1\n"
                          "  --mock-variable-seq-lengths: true\n  --mock-min-seqlen: 16\n"
                          "  --mock-max-seqlen: 64\n")
    load_recipe(recipe(tmp_path, varlen))  # the base is fine
    for extra, flag in (("  --mock-mean-seqlen: 100.0\n", "--mock-mean-seqlen"),
                        ("  --mock-seqlen-sigma: 0.0\n", "--mock-seqlen-sigma"),
                        ("  --mock-seqlen-sigma: 50.0\n", "--mock-seqlen-sigma")):
        assert flag in violations(recipe(tmp_path, varlen + extra))
    swapped = varlen.replace("--mock-min-seqlen: 16", "--mock-min-seqlen: 128")
    assert "--mock-min-seqlen" in violations(recipe(tmp_path, swapped))


BRIDGE = """ENV_VARS: {}
NPROC: 4
BRIDGE:
  recipe: %s
  recipe_args: {cmd: 'touch /tmp/pwned'}
  overrides: [train.train_iters=2]
"""


@pytest.mark.parametrize("spec", ["subprocess:getoutput", "os:system", "builtins:eval",
                                  "megatron_hcp.bridge:install", "x.y:_private", "a b:c"])
def test_recipe_functions_outside_the_recipe_modules_are_refused_at_load(tmp_path, spec):
    """BRIDGE.recipe 'subprocess:getoutput' passed load_recipe and every rank called it."""
    found = violations(recipe(tmp_path, BRIDGE % spec))
    assert "BRIDGE.recipe" in found


def test_an_explicitly_allowed_module_loads_and_reaches_every_rank(tmp_path):
    path = recipe(tmp_path, BRIDGE % "my_recipes.llama:tiny")
    assert "--allow-recipe-module my_recipes.llama" in violations(path)["BRIDGE.recipe"].fix
    loaded = load_recipe(path, allow_recipe_modules=["my_recipes.llama"])
    assert loaded.allowed == Allowed((), ("my_recipes.llama",))
    flags = loaded.worker_args("/work")
    opts = worker_parser().parse_args([str(path), "--out", "x", *flags[2:]])
    assert opts.allow_recipe_module == ["my_recipes.llama"]


def test_the_recipe_modules_pass_and_a_function_must_be_defined_where_named():
    assert check_recipe_function("megatron.bridge.recipes.llama.llama3:llama3_8b_pretrain"
                                 ) == ("megatron.bridge.recipes.llama.llama3",
                                       "llama3_8b_pretrain")
    assert check_recipe_function("tiny_llama_pretrain_config")[0] == (
        "megatron_hcp.bridge.recipes")
    # an allowed module re-exporting another module's function: refused when resolved
    with pytest.raises(CPConfigError, match="not a function defined in a recipe module"):
        _recipe_function("os.path:join", ["os.path"])


def test_allowed_loader_variables_reach_the_ranks_worker(tmp_path):
    """The worker loads the recipe again: without the caller's allowance it refused it."""
    path = recipe(tmp_path, BASE.replace("ENV_VARS: {}", "ENV_VARS: {LD_PRELOAD: /x.so}"))
    loaded = load_recipe(path, allow_env=["LD_PRELOAD"])
    opts = worker_parser().parse_args([str(path), "--out", "x", *loaded.worker_args("/w")])
    again = load_recipe(opts.recipe, allow_env=opts.allow_env,
                        allow_recipe_modules=opts.allow_recipe_module)
    assert again.env["LD_PRELOAD"] == "/x.so"


@pytest.mark.parametrize("env, parameter", [
    ("{OMP_NUM_THREADS: maybe}", "ENV_VARS.OMP_NUM_THREADS"),
    ("{OMP_NUM_THREADS: 0}", "ENV_VARS.OMP_NUM_THREADS"),
    ("{MEGATRON_HCP_FUSED_OPS: sometimes}", "ENV_VARS.MEGATRON_HCP_FUSED_OPS"),
    ("{MEGATRON_HCP_SPLIT_PACKED: x}", "ENV_VARS.MEGATRON_HCP_SPLIT_PACKED"),
    ("{MEGATRON_HCP_VARLEN: maybe}", "ENV_VARS.MEGATRON_HCP_VARLEN"),
])
def test_bad_rank_environment_in_a_recipe_is_refused_at_load(tmp_path, env, parameter):
    assert parameter in violations(recipe(tmp_path, BASE.replace("ENV_VARS: {}",
                                                                 f"ENV_VARS: {env}")))


def test_good_switch_values_pass(tmp_path):
    loaded = load_recipe(recipe(tmp_path, BASE.replace(
        "ENV_VARS: {}", "ENV_VARS: {MEGATRON_HCP_VARLEN: ' OFF ', OMP_NUM_THREADS: 2}")))
    assert loaded.env["MEGATRON_HCP_VARLEN"] == " OFF "


@pytest.mark.parametrize("variable", ["MEGATRON_HCP_FUSED_OPS", "MEGATRON_HCP_SPLIT_PACKED",
                                      "MEGATRON_HCP_VARLEN"])
def test_a_bad_switch_in_the_launchers_environment_stops_the_cli(monkeypatch, capsys,
                                                                 variable):
    monkeypatch.setenv(variable, "x" * 1_000_000)
    assert cli.parse_and_check(["functional", "run", "gpt3_mcore_tp1_pp1_cp4_p2p"]) == 2
    err = capsys.readouterr().err
    assert variable in err and len(err) < 1000  # the value quoted briefly, not whole


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("--hidden-size: 64", "--hidden-size: 1048576"),
    lambda t: t.replace("--vocab-size: 128", "--vocab-size: 16777216").replace(
        "--hidden-size: 64", "--hidden-size: 16384"),
])
def test_a_model_too_large_for_the_machine_is_refused_before_the_ranks_start(
        tmp_path, capsys, edit):
    path = recipe(tmp_path, edit(BASE))
    assert cli.parse_and_check(["functional", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "GiB per rank by the planner's memory model" in err and "available" in err


def test_memory_per_rank_counts_the_ranks_of_this_node_and_shipped_recipes_fit():
    loaded = load_recipe(recipe_dir("gpt3_mcore_tp1_pp1_cp4_p2p"))
    memory = recipe_memory(loaded)
    assert memory["total"] == pytest.approx(
        memory["weights_optimizer"] + memory["activations"] + memory["logits"])
    check_memory(loaded, 4, available=int(4 * memory["total"]) + 1)
    with pytest.raises(CPConfigError, match="for the 4 ranks of this node"):
        check_memory(loaded, 4, available=int(4 * memory["total"]) - 1)
    for name in list_recipes():
        shipped = load_recipe(recipe_dir(name))
        if hasattr(shipped, "spec"):
            check_memory(shipped, shipped.nproc)


@pytest.mark.parametrize("name", ["PYTHONBREAKPOINT", "PYTHONWARNINGS", "GCONV_PATH",
                                  "OMP_TOOL_LIBRARIES", "CUDA_INJECTION64_PATH",
                                  "NCCL_NET_PLUGIN"])
def test_variables_that_load_code_by_name_need_an_allowance(tmp_path, name):
    """PYTHONBREAKPOINT=module.callable passed without --allow-env."""
    path = recipe(tmp_path, BASE.replace("ENV_VARS: {}", f"ENV_VARS: {{{name}: x.y}}"))
    assert f"ENV_VARS.{name}" in violations(path)
    assert load_recipe(path, allow_env=[name]).env[name] == "x.y"
