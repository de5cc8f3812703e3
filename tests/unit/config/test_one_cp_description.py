"""One description of a CP setup: CPConfig holds it, every other shape reads it (issue: shape)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hcp.cli import main as cli_main
from megatron_hcp.config import DEFAULT_CP_COMM_TYPE, CPConfig, CPConfigError
from megatron_hcp.functional.recipe import _FLAGS, RECIPES_DIR, load_recipe
from megatron_hcp.training.trainer import TinyGPTSpec

ARGS = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
        "--hierarchical-context-parallel-sizes", "2", "2", "--num-attention-heads", "16",
        "--tensor-model-parallel-size", "2", "--data-parallel-size", "1"]


def test_megatron_flags_are_the_dialect_and_key_value_an_alias():
    flags = CPConfig.from_args(ARGS)
    pairs = CPConfig.from_pairs(["context_parallel_size=4", "cp_comm_type=a2a+p2p",
                                 "hierarchical_context_parallel_sizes=[2,2]",
                                 "num_attention_heads=16", "tensor_model_parallel_size=2",
                                 "data_parallel_size=1"])
    assert flags == pairs and flags.hierarchical_context_parallel_sizes == [2, 2]
    assert CPConfig.from_args(["--dynamic-context-parallel"]).dynamic_context_parallel is True
    with pytest.raises(CPConfigError, match="--bogus.*unknown parameter"):
        CPConfig.from_args(["--bogus", "1"])
    with pytest.raises(CPConfigError, match="context_parallel_size='four'"):
        CPConfig.from_args(["--context-parallel-size", "four"])


def test_cli_takes_the_same_flags_everywhere(capsys):
    assert cli_main(["check-config", *ARGS]) == 0
    assert "configuration is valid" in capsys.readouterr().out
    layout = ["layout", "--world-size", "8", "--tensor-model-parallel-size", "2",
              "--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2",
              "--json"]
    assert cli_main(layout) == 0
    long_form = capsys.readouterr().out
    assert cli_main(["layout", "--world-size", "8", "--tp", "2", "--cp", "4", "--hcp", "2,2",
                     "--json"]) == 0
    assert capsys.readouterr().out == long_form  # the short flags are aliases


def test_verify_groups_never_overrides_the_comm_type(capsys):
    # hierarchical sizes with another comm type: an error, not a silent a2a+p2p
    assert cli_main(["verify-groups", "--cp-comm-type", "p2p", "--hcp", "2", "2"]) == 2
    assert "hierarchical sizes only take effect with cp_comm_type a2a+p2p" in (
        capsys.readouterr().err)
    assert cli_main(["verify-groups", "--world-size", "6"]) == 2  # 6 ranks, tp*cp = 8
    assert "must be a multiple of tp*cp*pp=8" in capsys.readouterr().err


def test_the_trainer_spec_holds_one_cp_config():
    spec = TinyGPTSpec.of(context_parallel_size=4, cp_comm_type="a2a",
                          num_query_groups=2, steps=5)
    cp_fields = set(CPConfig.field_names())
    assert not cp_fields & {f.name for f in dataclasses.fields(TinyGPTSpec)}  # stored once
    assert spec.config.context_parallel_size == spec.topology.cp == 4
    assert spec.steps == 5 and spec.config.num_layers == 2  # the spec's model default, in config
    assert TinyGPTSpec().config.comm_type == DEFAULT_CP_COMM_TYPE == "p2p"
    # no second path to the config's fields: sizes come from the topology, the rest from config
    for name in ("context_parallel_size", "num_layers", "not_a_field"):
        with pytest.raises(AttributeError):
            getattr(spec, name)
    topology = spec.topology
    assert topology is spec.topology and topology.config is spec.config  # resolved once
    spec.config = dataclasses.replace(spec.config, context_parallel_size=2, data_parallel_size=2)
    assert spec.topology.cp == 2 and spec.topology.dp == 2  # a new config, a new topology


def test_each_recipe_flag_maps_to_one_field_once():
    fields = [name for name, _ in _FLAGS.values() if name is not None]
    assert len(fields) == len(set(fields)), sorted(fields)
    recipe = load_recipe(RECIPES_DIR / "gpt3_mcore_tp2_pp1_cp4_dcp")
    assert recipe.config is recipe.spec.config  # the recipe's CP setup is its spec's
    flat = recipe.with_cp1()
    assert flat.config.context_parallel_size == 1 and not flat.spec.topology.dynamic
    assert flat.spec.config is flat.config


def test_one_field_table_serves_recipes_bridge_the_trainer_and_the_parser():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hcp.bridge.config import MODEL_FIELDS
    from megatron_hcp.config import FIELD_KINDS, FIELDS, fields_read_by
    from megatron_hcp.training import trainer

    assert list(FIELDS) == CPConfig.field_names() and list(FIELD_KINDS) == list(FIELDS)
    recipe_fields = [name for name, _ in _FLAGS.values() if name in FIELDS]
    assert recipe_fields == list(fields_read_by("recipe"))
    assert MODEL_FIELDS == fields_read_by("bridge")
    given = set(fields_read_by("transformer"))
    assert given <= set(trainer._SET_BY_SPEC)  # extra_config may not set them
    declared = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert given <= declared, given - declared  # megatron's own names
    # the fields no client reads by name are this project's own (validation inputs)
    assert {n for n, (_, by) in FIELDS.items() if not by} == {
        "data_parallel_size", "use_megatron_fsdp", "te_version", "cp_attention_backend"}
