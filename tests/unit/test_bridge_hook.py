"""megatron_hcp.bridge.install() against a stand-in with Bridge's signatures (single process).

The multi-rank half (hooked collection equals the MPU path; TE modules get ``hcp`` back after
Bridge's flat rebinding) is in test_decentralized.py, which has the 8-rank world.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from megatron_hcp.bridge import hook
from megatron_hcp.config import CPConfig, CPConfigError

from . import _bridge_standin as standin


@pytest.fixture
def bridge():
    mods = standin.install_standin()
    yield mods
    standin.remove_standin()


def test_without_bridge_install_says_so():
    assert "megatron.bridge" not in sys.modules
    with pytest.raises(hook.BridgeNotInstalledError, match="Megatron-Bridge is not installed"):
        hook.install()
    assert not hook.installed()


def test_install_is_idempotent_and_reversible(bridge):
    init, mls = bridge["initialize"], bridge["model_load_save"]
    originals = (init._create_pg_collection, standin.GPTModelProvider.provide,
                 mls.load_megatron_model,
                 bridge["eval_context_parallel_rebinding"].install_pg_collection)
    hcp_cfg = standin.SimpleNamespace(hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(NotImplementedError):  # Bridge without the hook
        init._create_pg_collection(hcp_cfg, 1)
    hook.install()
    wrapped = init._create_pg_collection
    assert hook.installed() and wrapped is not originals[0]
    assert wrapped.__wrapped__ is originals[0]
    assert bridge["diffusion_pipeline"]._load_megatron_model is mls.load_megatron_model
    hook.install()  # again: nothing wrapped twice
    assert init._create_pg_collection is wrapped
    hook.uninstall()
    assert not hook.installed()
    assert (init._create_pg_collection, standin.GPTModelProvider.provide,
            mls.load_megatron_model,
            bridge["eval_context_parallel_rebinding"].install_pg_collection) == originals
    assert bridge["diffusion_pipeline"]._load_megatron_model is originals[2]
    with pytest.raises(NotImplementedError):  # Bridge's own behaviour is back
        init._create_pg_collection(hcp_cfg, 1)
    hook.uninstall()  # no-op


def test_a_different_bridge_is_refused_and_nothing_changes():
    def changed(config, instances):  # not Bridge's signature
        return None

    mods = standin.install_standin(create_pg_collection=changed)
    try:
        provide = standin.GPTModelProvider.provide
        with pytest.raises(hook.BridgeHookError, match="_create_pg_collection"):
            hook.install()
        assert standin.GPTModelProvider.provide is provide  # atomic: nothing patched
        assert mods["initialize"]._create_pg_collection is changed
    finally:
        standin.remove_standin()


def test_configs_without_hcp_go_to_bridge_unchanged(bridge):
    hook.install()
    cfg = standin.SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=4,
                                  cp_comm_type="p2p", hierarchical_context_parallel_sizes=None)
    out = bridge["initialize"]._create_pg_collection(cfg, 1, world_size=8, rank_offset=8)
    assert out == ("bridge", 8, 8, False)


def test_hcp_configs_are_validated_before_any_group(bridge):
    hook.install()
    cfg = standin.SimpleNamespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=4,
        cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3])
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        bridge["initialize"]._create_pg_collection(cfg, 1, world_size=4)
    cfg.hierarchical_context_parallel_sizes = [2, 2]
    with pytest.raises(CPConfigError, match="num_distributed_optimizer_instances"):
        bridge["initialize"]._create_pg_collection(cfg, 2, world_size=4)


# ------------------------------------------------------------- load_megatron_model decision
@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=4,
        cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2],
        num_attention_heads=8, num_query_groups=4, num_layers=2)))
    return tmp_path


def test_load_restores_the_checkpoints_sizes_when_cp_matches(bridge, checkpoint, caplog):
    cfg = bridge["model_load_save"].load_megatron_model(
        str(checkpoint), mp_overrides={"context_parallel_size": 4})
    # without the hook Bridge drops the sizes silently
    assert cfg.context_parallel_size == 4 and cfg.hierarchical_context_parallel_sizes is None
    hook.install()
    with caplog.at_level(logging.WARNING, logger="megatron_hcp"):
        cfg = bridge["model_load_save"].load_megatron_model(
            str(checkpoint), mp_overrides={"context_parallel_size": 4})
    assert cfg.hierarchical_context_parallel_sizes == [2, 2]
    assert "restored" in caplog.text
    # the by-value importer gets the same decision
    cfg = bridge["diffusion_pipeline"]._load_megatron_model(
        str(checkpoint), mp_overrides={"context_parallel_size": 4})
    assert cfg.hierarchical_context_parallel_sizes == [2, 2]


def test_load_with_another_cp_size_asks_for_the_sizes(bridge, checkpoint):
    hook.install()
    load = bridge["model_load_save"].load_megatron_model
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes") as info:
        load(str(checkpoint), mp_overrides={"context_parallel_size": 8})
    assert "mp_overrides" in str(info.value) and "[2, 2]" in str(info.value)
    cfg = load(str(checkpoint), mp_overrides={"context_parallel_size": 8,
                                              "hierarchical_context_parallel_sizes": [4, 2]})
    assert cfg.hierarchical_context_parallel_sizes == [4, 2]
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        load(str(checkpoint), mp_overrides={"context_parallel_size": 8,
                                            "hierarchical_context_parallel_sizes": [2, 2]})


def test_load_with_cp1_logs_the_unused_sizes(bridge, checkpoint, caplog):
    hook.install()
    with caplog.at_level(logging.INFO, logger="megatron_hcp"):
        cfg = bridge["model_load_save"].load_megatron_model(str(checkpoint))
    assert cfg.context_parallel_size == 1 and cfg.hierarchical_context_parallel_sizes is None
    assert "[2, 2]" in caplog.text and "not used" in caplog.text


def test_load_leaves_bridge_module_as_it_was(bridge, checkpoint):
    hook.install()
    mls = bridge["model_load_save"]
    before = (mls.load_model_config, mls.build_and_load_model)
    with pytest.raises(CPConfigError):
        mls.load_megatron_model(str(checkpoint), mp_overrides={"context_parallel_size": 8})
    assert (mls.load_model_config, mls.build_and_load_model) == before


# ------------------------------------------------------------- Bridge-style overrides
def test_bridge_style_overrides_go_through_validation():
    base = CPConfig(context_parallel_size=4, tensor_model_parallel_size=2,
                    num_attention_heads=8, num_query_groups=4)
    config, dist_settings = hook.cp_config_from_overrides(
        ["model.cp_comm_type=a2a+p2p", "model.hierarchical_context_parallel_sizes=[2,2]",
         "dist.use_decentralized_pg=True", "train.micro_batch_size=1"], base)
    assert config.cp_comm_type == "a2a+p2p"
    assert config.hierarchical_context_parallel_sizes == [2, 2]
    assert config.tensor_model_parallel_size == 2  # kept from base
    assert dist_settings == {"use_decentralized_pg": True}
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        hook.cp_config_from_overrides(["model.cp_comm_type=a2a+p2p"], base)
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        hook.cp_config_from_overrides(
            ["model.cp_comm_type=a2a+p2p", "model.hierarchical_context_parallel_sizes=[4,2]"],
            base)
    with pytest.raises(CPConfigError, match="section.key=value"):
        hook.cp_config_from_overrides(["cp_comm_type"], base)
