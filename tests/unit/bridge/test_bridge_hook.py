"""megatron_hcp.bridge.install() against Megatron-Bridge (single process).

Python 3.12 leg: the installed Megatron-Bridge 0.6.2; Python 3.11 leg: the stand-in (see
tests/unit/bridge/_bridge.py for which shims each uses and why). The multi-rank half (hooked
collection equals the MPU path; TE modules get ``hcp`` back after Bridge's flat rebinding) is in
test_decentralized.py, which has the 8-rank world.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from megatron_hcp.bridge import hook
from megatron_hcp.config import CPConfig, CPConfigError

from . import _bridge


def model_config(**fields) -> SimpleNamespace:
    """The fields of a Bridge model config that the wrapped function reads."""
    return SimpleNamespace(**{"expert_tensor_parallel_size": None,
                              "expert_model_parallel_size": 1, **fields})


@pytest.fixture
def bridge():
    mods = _bridge.load()
    yield mods
    _bridge.release()


def test_without_bridge_install_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # not importable
    with pytest.raises(hook.BridgeNotInstalledError, match="Megatron-Bridge is not installed"):
        hook.install()
    assert not hook.installed()


def test_the_leg_runs_the_bridge_it_should(bridge):
    """3.12: Bridge's own modules (not the stand-in); 3.11: the stand-in."""
    init = bridge["initialize"]
    assert init.__name__ == "megatron.bridge.training.initialize"
    assert (getattr(init, "__file__", None) is not None) == _bridge.REAL
    if _bridge.REAL:
        from importlib.metadata import version

        assert version("megatron-bridge") == "0.6.2"


def test_install_is_idempotent_and_reversible(bridge):
    init, mls = bridge["initialize"], bridge["model_load_save"]
    provider = _bridge.provider_class(bridge)
    originals = (init._create_pg_collection, provider.provide,
                 mls.load_megatron_model,
                 bridge["eval_context_parallel_rebinding"].install_pg_collection)
    hcp_cfg = model_config(hierarchical_context_parallel_sizes=[2, 2])
    with pytest.raises(NotImplementedError):  # Bridge without the hook
        init._create_pg_collection(hcp_cfg, 1)
    hook.install()
    wrapped = init._create_pg_collection
    assert hook.installed() and wrapped is not originals[0]
    assert wrapped.__wrapped__ is originals[0]
    assert bridge["by_value"]._load_megatron_model is mls.load_megatron_model
    hook.install()  # again: nothing wrapped twice
    assert init._create_pg_collection is wrapped
    hook.uninstall()
    assert not hook.installed()
    assert (init._create_pg_collection, provider.provide,
            mls.load_megatron_model,
            bridge["eval_context_parallel_rebinding"].install_pg_collection) == originals
    assert bridge["by_value"]._load_megatron_model is originals[2]
    with pytest.raises(NotImplementedError):  # Bridge's own behaviour is back
        init._create_pg_collection(hcp_cfg, 1)
    hook.uninstall()  # no-op


def test_a_different_bridge_is_refused_and_nothing_changes(bridge, monkeypatch):
    def changed(config, instances):  # not Bridge's signature
        return None

    monkeypatch.setattr(bridge["initialize"], "_create_pg_collection", changed)
    provider = _bridge.provider_class(bridge)
    provide = provider.provide
    with pytest.raises(hook.BridgeHookError, match="_create_pg_collection"):
        hook.install()
    assert provider.provide is provide  # atomic: nothing patched
    assert bridge["initialize"]._create_pg_collection is changed


def test_configs_without_hcp_go_to_bridge_unchanged(bridge):
    hook.install()
    cfg = model_config(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       context_parallel_size=4, cp_comm_type="p2p",
                       hierarchical_context_parallel_sizes=None)
    if _bridge.REAL:  # Bridge's own function runs (its own check, before its NCCL grids)
        with pytest.raises(RuntimeError, match=r"world_size \(7\) is not divisible by 4"):
            bridge["initialize"]._create_pg_collection(cfg, 1, world_size=7, rank_offset=8)
    else:
        out = bridge["initialize"]._create_pg_collection(cfg, 1, world_size=8, rank_offset=8)
        assert out == ("bridge", 8, 8, False)


def test_hcp_configs_are_validated_before_any_group(bridge):
    hook.install()
    cfg = model_config(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=4,
        cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3])
    with pytest.raises(CPConfigError, match="hierarchical_context_parallel_sizes"):
        bridge["initialize"]._create_pg_collection(cfg, 1, world_size=4)
    cfg.hierarchical_context_parallel_sizes = [2, 2]
    with pytest.raises(CPConfigError, match="num_distributed_optimizer_instances"):
        bridge["initialize"]._create_pg_collection(cfg, 2, world_size=4)


HCP = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=4,
           cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])


@pytest.mark.parametrize("fields, instances, named", [
    ({"context_parallel_size": 0, "hierarchical_context_parallel_sizes": [1, 1]}, 1,
     "context_parallel_size=0: must be >= 1"),
    ({"context_parallel_size": 4.9}, 1, "context_parallel_size=4.9: must be an integer"),
    ({"tensor_model_parallel_size": "2"}, 1, "tensor_model_parallel_size='2': must be an integer"),
    ({"tensor_model_parallel_size": "abc"}, 1,
     "tensor_model_parallel_size='abc': must be an integer"),
    ({"pipeline_model_parallel_size": True}, 1,
     "pipeline_model_parallel_size=True: must be an integer"),
    ({"hierarchical_context_parallel_sizes": 4}, 1,
     "hierarchical_context_parallel_sizes=4: must be a list of integers"),
    ({"hierarchical_context_parallel_sizes": [2.0, 2]}, 1,
     "hierarchical_context_parallel_sizes[0]=2.0: must be an integer"),
    ({"num_attention_heads": 8.5}, 1, "num_attention_heads=8.5: must be an integer"),
    ({}, 0, "num_distributed_optimizer_instances=0: must be the integer 1"),
    ({}, -1, "num_distributed_optimizer_instances=-1: must be the integer 1"),
    ({}, 1.0, "num_distributed_optimizer_instances=1.0: must be the integer 1"),
])
def test_bridge_values_are_read_strictly_never_coerced(bridge, fields, instances, named):
    """Through the hooked Bridge function before 0462398 (2026-11-24): 0 was read as 1, 4.9 as 4,
    "2" as TP 2, 0 / -1 optimizer instances passed, an int as the sizes or "abc" as TP were raw
    TypeError / ValueError; each is now a CPConfigError naming the field, the value, the rule and
    the fix, before any group exists."""
    hook.install()
    cfg = model_config(**{**HCP, **fields})
    with pytest.raises(CPConfigError) as info:
        bridge["initialize"]._create_pg_collection(cfg, instances, world_size=4)
    assert named in str(info.value) and "Fix:" in str(info.value), info.value


def test_every_bad_bridge_field_is_reported_at_once():
    cfg = model_config(**{**HCP, "tensor_model_parallel_size": "2", "context_parallel_size": 0,
                          "num_layers": -3})
    with pytest.raises(CPConfigError) as info:
        hook.cp_config_from_model_config(cfg, 8)
    assert {v.parameter for v in info.value.violations} == {
        "model.tensor_model_parallel_size", "model.context_parallel_size", "model.num_layers"}


# ------------------------------------------------------------- load_megatron_model decision
@pytest.fixture
def checkpoint(bridge, tmp_path, monkeypatch):
    _bridge.build_recorder(bridge, monkeypatch)
    return _bridge.write_checkpoint(
        tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        context_parallel_size=4, cp_comm_type="a2a+p2p",
        hierarchical_context_parallel_sizes=[2, 2], num_attention_heads=8, num_query_groups=4,
        num_layers=2)


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
    cfg = bridge["by_value"]._load_megatron_model(
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
