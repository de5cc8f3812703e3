"""Bridge's own model recipe functions from a local Hugging Face config directory, no download.

``megatron_hcp.bridge.offline.recipe_from_hf_config`` runs the installed Bridge 0.6.2's recipe
functions (Qwen3-MoE's ``qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config``, Qwen3's, Llama 3's) as
they are, with tiny ``transformers`` configs saved by ``save_pretrained``; the network is cut
for the call (any connection attempt fails the test).
"""

from __future__ import annotations

import socket

import pytest

from megatron_hcp.config import CPConfigError
from tests.unit.bridge._bridge import REAL

pytestmark = pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only")


@pytest.fixture(scope="module")
def bridge():
    import megatron.core  # noqa: F401  (before the shim: megatron keeps HAVE_TE=False)

    from tests.unit.bridge._bridge import te_import_shim

    te_import_shim()
    from megatron.bridge import AutoBridge

    return AutoBridge


@pytest.fixture
def offline(monkeypatch):
    """No connection can be made while the test runs."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _recipe(family: str):
    from tests.unit.bridge._families import RECIPES

    return RECIPES[family]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3", "llama3"])
def test_a_bridge_recipe_builds_from_a_local_config(bridge, offline, tmp_path, family):
    import huggingface_hub.constants as hub

    from megatron_hcp.bridge.offline import recipe_from_hf_config
    from tests.unit.bridge._families import write_tiny_config

    directory = write_tiny_config(family, tmp_path / family)
    loader, hub_offline = bridge.__dict__["from_hf_pretrained"], hub.HF_HUB_OFFLINE
    cfg = recipe_from_hf_config(_recipe(family), directory)
    model = cfg.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads,
            model.num_query_groups, model.vocab_size) == (2, 64, 4, 2, 256)
    assert model.hf_model_id == str(directory)
    if family == "qwen3_moe":  # the architecture from the config, the rest from the recipe
        assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size,
                model.qk_layernorm) == (8, 2, 32, True)
        assert (model.tensor_model_parallel_size, model.pipeline_model_parallel_size,
                model.expert_model_parallel_size) == (4, 2, 4)
    # a tokenizer named by the Hub id becomes a NullTokenizer over the config's vocabulary;
    # Llama 3's recipe has its own NullTokenizer (mock data), kept as the recipe made it
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.vocab_size) == (
        "NullTokenizer", 32000 if family == "llama3" else 256)
    assert "revision" not in (cfg.tokenizer.hf_tokenizer_kwargs or {})
    # what the call replaced is back
    assert bridge.__dict__["from_hf_pretrained"] is loader and hub.HF_HUB_OFFLINE == hub_offline


def test_a_local_tokenizer_is_the_recipes_tokenizer(bridge, offline, tmp_path):
    from megatron_hcp.bridge.offline import recipe_from_hf_config
    from megatron_hcp.bridge.recipes import write_tokenizer
    from tests.unit.bridge._families import write_tiny_config

    directory = write_tiny_config("qwen3_moe", tmp_path / "model")
    write_tokenizer(tmp_path / "tokenizer", 256)
    for item in (tmp_path / "tokenizer").iterdir():
        item.rename(directory / item.name)
    cfg = recipe_from_hf_config(_recipe("qwen3_moe"), directory)
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == (
        "HuggingFaceTokenizer", str(directory))


def test_a_config_object_works_too_and_the_recipe_takes_its_arguments(bridge, offline):
    from transformers import Qwen3MoeConfig

    from megatron_hcp.bridge.offline import recipe_from_hf_config

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    cfg = recipe_from_hf_config(
        "megatron.bridge.recipes.qwen.h100.qwen3_moe:qwen3_30b_a3b_peft_4gpu_h100_bf16_config",
        config, peft_scheme="dora")
    assert (cfg.model.num_layers, cfg.model.num_moe_experts) == (1, 4)
    assert type(cfg.peft).__name__ == "DoRA"


def test_errors_name_the_parameter_and_the_fix(bridge, offline, tmp_path):
    from megatron_hcp.bridge.offline import recipe_from_hf_config

    with pytest.raises(CPConfigError, match=r"hf_config='Qwen/Qwen3-30B-A3B': is not a local "
                       r"directory with a config.json"):
        recipe_from_hf_config(_recipe("qwen3_moe"), "Qwen/Qwen3-30B-A3B")
    with pytest.raises(CPConfigError, match="hf_config=3: must be a transformers"):
        recipe_from_hf_config(_recipe("qwen3_moe"), 3)
    from tests.unit.bridge._families import write_tiny_config

    directory = write_tiny_config("llama3", tmp_path / "llama")
    with pytest.raises(CPConfigError, match="recipe='no.such:recipe': must be a recipe function"):
        recipe_from_hf_config("no.such:recipe", directory)
    with pytest.raises(CPConfigError, match="asked for no Hugging Face model"):
        recipe_from_hf_config("megatron_hcp.bridge.recipes:tiny_llama_pretrain_config",
                              directory)


def test_what_the_call_replaced_is_back_when_the_recipe_raises(bridge, offline, tmp_path):
    import huggingface_hub.constants as hub
    from transformers import AutoConfig

    from megatron_hcp.bridge.offline import recipe_from_hf_config
    from tests.unit.bridge._families import write_tiny_config

    def broken():
        from megatron.bridge import AutoBridge

        AutoBridge.from_hf_pretrained("Org/model")
        raise RuntimeError("the recipe failed")

    directory = write_tiny_config("llama3", tmp_path / "llama")
    before = (bridge.__dict__["from_hf_pretrained"], AutoConfig.__dict__["from_pretrained"],
              hub.HF_HUB_OFFLINE)
    with pytest.raises(RuntimeError, match="the recipe failed"):
        recipe_from_hf_config(broken, directory)
    assert (bridge.__dict__["from_hf_pretrained"], AutoConfig.__dict__["from_pretrained"],
            hub.HF_HUB_OFFLINE) == before


def test_the_family_recipe_is_bridges_recipe_offline_as_a_cpu_run(bridge, offline, tmp_path):
    """``tiny_family_pretrain_config`` (the functional recipes' function): Bridge's own recipe of
    the family from the tiny config it writes under ``data_dir`` (no temporary left, written
    again by another rank as it is), or from the config in memory; a CPU fp32 run."""
    from megatron_hcp.bridge.family_recipes import (
        FAMILY_RECIPES,
        tiny_family_pretrain_config,
        write_tiny_config,
    )
    from megatron_hcp.functional.bridge_recipe import _recipe_function

    assert _recipe_function("tiny_family_pretrain_config") is tiny_family_pretrain_config
    cfg = tiny_family_pretrain_config("qwen3_moe", data_dir=str(tmp_path), train_iters=3)
    written = tmp_path / "qwen3_moe-config" / "config.json"
    before = written.read_text()
    write_tiny_config("qwen3_moe", written.parent)  # a second rank's write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3_moe-config"]
    assert written.read_text() == before and "Qwen3MoeForCausalLM" in before
    model = cfg.model
    assert (model.num_layers, model.num_moe_experts, model.bf16, model.transformer_impl,
            model.moe_token_dispatcher_type, model.context_parallel_size) == (
        2, 8, False, "local", "alltoall", 1)
    assert (cfg.train.train_iters, cfg.tokenizer.tokenizer_type) == (3, "NullTokenizer")
    assert type(cfg.dataset).__name__ == "MockGPTDatasetConfig"
    assert tiny_family_pretrain_config("qwen3_moe").model.num_moe_experts == 8  # in memory
    assert {"qwen3_moe", "deepseek_v3", "gpt_oss"} <= set(FAMILY_RECIPES)
    with pytest.raises(ValueError, match="family='nope'"):
        tiny_family_pretrain_config("nope")
