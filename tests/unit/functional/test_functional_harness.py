"""Recipe parsing (flags -> validated config) and golden-value comparison (pure)."""

from __future__ import annotations

import copy
import json

import pytest

from megatron_hcp.config import CPConfigError
from megatron_hcp.functional.golden import compare, to_golden
from megatron_hcp.functional.recipe import Recipe, list_recipes, load_recipe


def write_recipe(tmp_path, args, nproc=4, test_type="regular"):
    lines = ["ENV_VARS: {}", f"NPROC: {nproc}", f"TEST_TYPE: {test_type}", "MODEL_ARGS:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in args.items()]
    (tmp_path / "model_config.yaml").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_every_shipped_recipe_parses_to_a_valid_config():
    names = list_recipes()
    assert "gpt3_mcore_tp2_pp1_cp4_dcp" in names and len(names) >= 8
    for name in names:
        from megatron_hcp.functional.recipe import RECIPES_DIR

        recipe = load_recipe(RECIPES_DIR / name)
        assert recipe.nproc <= 8
        assert recipe.config.world_size == recipe.nproc
    dcp = load_recipe(RECIPES_DIR / "gpt3_mcore_tp2_pp1_cp4_dcp")
    assert dcp.config.dynamic_context_parallel and dcp.spec.varlen is not None
    assert dcp.spec.topology.tp == 2 and dcp.config.dp_cp_size == 4
    flat = dcp.with_cp1()
    assert flat.config.context_parallel_size == 1 and flat.config.data_parallel_size == 4
    assert not flat.spec.topology.dynamic
    # faithful to upstream's dcp recipe: ckpt-resume, SP on, a corpus the model learns
    assert dcp.test_type == "ckpt-resume" and dcp.spec.varlen.corpus == "markov"
    for name in names:  # every TP recipe runs with sequence parallelism, like upstream's
        recipe = load_recipe(RECIPES_DIR / name)
        sp = (recipe.spec.sequence_parallel if isinstance(recipe, Recipe)
              else "model.sequence_parallel=true" in recipe.overrides)  # a Bridge recipe
        assert sp == (recipe.config.tensor_model_parallel_size > 1), name


@pytest.mark.parametrize("args, parameter", [
    ({"--context-parallel-size": 4, "--cp-comm-type": "p2p",
      "--hierarchical-context-parallel-sizes": [2, 2]}, "hierarchical_context_parallel_sizes"),
    ({"--context-parallel-size": 4, "--cp-comm-type": "a2a+p2p",
      "--hierarchical-context-parallel-sizes": [2, 3]}, "hierarchical_context_parallel_sizes"),
    ({"--context-parallel-size": 4, "--dynamic-context-parallel": True},
     "max_seqlen_per_dp_cp_rank"),
    ({"--context-parallel-size": 4, "--bf16": True}, "--bf16"),
    ({"--context-parallel-size": 4, "--tokenizer-type": "GPT2BPETokenizer"}, "--tokenizer-type"),
    ({"--context-parallel-size": 3}, "data_parallel_size"),
    ({"--mock-variable-seq-lengths": True, "--mock-corpus": "shakespeare"}, "--mock-corpus"),
    ({"--mock-corpus": "markov"}, "--mock-corpus"),  # without varlen data it would do nothing
])
def test_bad_flags_get_the_config_errors(tmp_path, args, parameter):
    with pytest.raises(CPConfigError) as info:
        load_recipe(write_recipe(tmp_path, args))
    assert any(v.parameter == parameter for v in info.value.violations), info.value


def metrics(losses, zeros):
    steps = range(1, len(losses) + 1)
    return {"lm loss": dict(zip(steps, losses)), "num-zeros": dict(zip(steps, zeros)),
            "iteration-time": dict.fromkeys(steps, 1.0),
            "mem-allocated-bytes": dict.fromkeys(steps, 1e9)}


def test_golden_format_is_megatrons():
    golden = to_golden(metrics([4.0, 3.5], [10, 12]))
    assert golden["lm loss"] == {"start_step": 1, "end_step": 2, "step_interval": 1,
                                 "values": {"1": 4.0, "2": 3.5}}
    assert set(golden) == {"lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes"}


def test_compare_rules():
    losses = [4.0 - 0.01 * i for i in range(40)]
    zeros = [100.0] * 40
    golden = to_golden(metrics(losses, zeros))
    assert compare(metrics(losses, zeros), golden).passed
    # lm loss: within rtol 0.05 passes, beyond on more than 5% of the steps fails
    near = [x * 1.04 for x in losses]
    assert compare(metrics(near, zeros), golden).passed
    far = copy.copy(losses)
    far[3] *= 1.2
    assert compare(metrics(far, zeros), golden).passed  # 1 of 40 steps: fraction rule
    far[4] *= 1.2
    far[5] *= 1.2
    assert not compare(metrics(far, zeros), golden).passed  # 3 of 40 > 5 %
    # num-zeros: rtol 0.20
    assert compare(metrics(losses, [119.0] * 40), golden).passed
    assert not compare(metrics(losses, [125.0] * 40), golden).passed
    # time and memory are reported, never gated
    slow = metrics(losses, zeros)
    slow["iteration-time"] = dict.fromkeys(range(1, 41), 100.0)
    result = compare(slow, golden)
    assert result.passed and any("iteration-time: reported" in line for line in result.lines)
    assert not compare(metrics([float("nan")] * 40, zeros), golden).passed
