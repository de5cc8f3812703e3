"""megatron-hcp's Bridge spec is the provider's own spec with only the core attention swapped.

Python 3.12 leg (Megatron-Bridge 0.6.2's own code, single process): for each family the providers
are built by the family's own Bridge class (``provider_bridge``) from a tiny Hugging Face config
made in memory (no download) - Llama 3 (GQA), Qwen3 (q/k norm), Qwen3-MoE (8 experts), DeepSeek-V3
(MLA, MoE with shared experts, ``moe_layer_freq``, MTP), Gemma 3 (windows), gpt-oss (sinks,
windows on every other layer, MoE), Nemotron-H (Mamba hybrid). The reference is what Bridge
builds for the same provider on this machine without megatron-hcp: Transformer Engine is absent,
Bridge's TE spec functions cannot build a layer here, so for the providers on Bridge's default
spec the reference is Bridge's own ``local_layer_spec``, for a family spec function taking
``use_transformer_engine`` (DeepSeek) that function with it False, for Gemma 3's spec (TE
modules only) its local twins (``megatron_hcp.bridge.local_layers``; the translation is checked
module by module against Bridge's TE spec), and for megatron's hybrid stack (TE layers only) the
provider's spec as Bridge resolves it. The two spec trees are compared node by node (module
classes, params, every submodule, builders' keywords); the only differences allowed are the
core attention (the project's CP attention) and, under sequence parallelism, megatron's
``WrappedTorchNorm`` -> ``SequenceParallelTorchNorm``. A planted difference (the old spec, which
passed only MLA on) fails the comparison.

The Bridge-free part (spec-tree walk, SP norms, per-layer windows, the local build from a
spec function) also runs on the py311 leg against megatron-core 0.16.1.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_hcp.attention.module import ReferenceCPAttention
from megatron_hcp.bridge import spec as hcp_spec
from megatron_hcp.layers.norm import SequenceParallelTorchNorm

from . import _bridge

needs_bridge = pytest.mark.skipif(not _bridge.REAL, reason="Megatron-Bridge 0.6.2 needs "
                                  "Python 3.12 (the py312 leg runs these)")
CP_ATTENTION = (ReferenceCPAttention, hcp_spec.LayerWindowCPAttention)


# ------------------------------------------------------------------ the comparison
def _walk(ref: Any, ours: Any, path: str, out: list) -> None:
    """Every node where ``ours`` differs from ``ref``: (path, ref value, our value)."""
    if isinstance(ref, functools.partial) or isinstance(ours, functools.partial):
        if not (isinstance(ref, functools.partial) and isinstance(ours, functools.partial)):
            out.append((path, ref, ours))
            return
        _walk(ref.func, ours.func, f"{path}.<func>", out)
        _walk(list(ref.args), list(ours.args), f"{path}.<args>", out)
        _walk(ref.keywords, ours.keywords, path, out)
        return
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        if type(ref) is not type(ours):
            out.append((path, type(ref), type(ours)))
            return
        for field in dataclasses.fields(ref):
            _walk(getattr(ref, field.name), getattr(ours, field.name), f"{path}.{field.name}",
                  out)
        return
    if isinstance(ref, (list, tuple)):
        if type(ref) is not type(ours) or len(ref) != len(ours):
            out.append((path, ref, ours))
            return
        for i, (a, b) in enumerate(zip(ref, ours)):
            _walk(a, b, f"{path}[{i}]", out)
        return
    if isinstance(ref, dict):
        if not isinstance(ours, dict) or set(ref) != set(ours):
            out.append((path, ref, ours))
            return
        for key in ref:
            _walk(ref[key], ours[key], f"{path}.{key}", out)
        return
    if ref is not ours and not (type(ref) is type(ours) and _by_value(ref) and ref == ours):
        out.append((path, ref, ours))


def _by_value(value: Any) -> bool:
    """Values compared by ==: plain values, enums, bound methods (a new object per access:
    ``MLP.as_mlp_submodule``); everything else (classes, functions, placeholders) by identity."""
    return (isinstance(value, (int, float, str, bool, type(None), enum.Enum))
            or inspect.ismethod(value))


def differences(ref: Any, ours: Any, *, sequence_parallel: bool = False) -> list:
    """The differences of ``ours`` from ``ref`` other than (a) the core attention, which must be
    the project's CP attention, and (b) with SP, WrappedTorchNorm -> SequenceParallelTorchNorm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    found: list = []
    _walk(ref, ours, "spec", found)
    left = []
    for path, a, b in found:
        if path.endswith(".core_attention") and b in CP_ATTENTION and a is not None:
            continue
        if sequence_parallel and a is WrappedTorchNorm and b is SequenceParallelTorchNorm:
            continue
        left.append((path, a, b))
    return left


def assert_only_attention_swapped(ref: Any, ours: Any, *, sequence_parallel: bool = False):
    left = differences(ref, ours, sequence_parallel=sequence_parallel)
    assert not left, "the spec differs from the provider's own beyond the core attention:\n" + (
        "\n".join(f"  {p}: {a!r} -> {b!r}" for p, a, b in left))


def _leaves(node: Any) -> list[Any]:
    """Every leaf value of a spec tree (classes, functions, placeholders, plain values)."""
    if isinstance(node, functools.partial):
        return [*_leaves(node.func), *_leaves(list(node.args)), *_leaves(node.keywords)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [v for f in dataclasses.fields(node) for v in _leaves(getattr(node, f.name))]
    if isinstance(node, (list, tuple)):
        return [v for item in node for v in _leaves(item)]
    if isinstance(node, dict):
        return [v for item in node.values() for v in _leaves(item)]
    return [node]


def _name(obj: Any) -> str:
    """The class or function a spec node builds: a ModuleSpec's module, a builder's function,
    a class's ``as_mlp_submodule`` its class (megatron 0.19 builds MLPs that way)."""
    while True:
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif dataclasses.is_dataclass(obj) and hasattr(obj, "module"):
            obj = obj.module
        elif inspect.ismethod(obj) and isinstance(obj.__self__, type):
            obj = obj.__self__
        else:
            return getattr(obj, "__name__", type(obj).__name__)


# ------------------------------------------------------------------ Bridge-free (both legs)
def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, normalization="RMSNorm", qk_layernorm=True,
                num_moe_experts=4, moe_layer_freq=[0, 1, 0, 1], moe_ffn_hidden_size=32,
                moe_router_topk=2, moe_shared_expert_intermediate_size=32,
                add_bias_linear=False, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **kw})


def _deepseek_like_own_spec():
    """What DeepSeek's / GLM's bridges set: megatron's block spec with TE where TE imports."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return functools.partial(get_gpt_decoder_block_spec, use_transformer_engine=True)


def _local_block(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)


def test_local_build_keeps_the_per_layer_pattern():
    """A spec function taking use_transformer_engine (DeepSeek's bridge sets one) is called with
    it False: MoE every other layer, shared experts, q/k norms - only the attention swapped."""
    config = _config()
    ours = hcp_spec.layer_spec(config, backend="reference", own=_deepseek_like_own_spec())
    ref = _local_block(config)
    assert_only_attention_swapped(ref, ours)
    assert [_name(layer.submodules.mlp) for layer in ours.layer_specs] == [
        "MLP", "MoELayer", "MLP", "MoELayer"]
    assert ours.layer_specs[1].submodules.mlp is not None
    for layer in ours.layer_specs:
        attention = layer.submodules.self_attention.submodules
        assert attention.core_attention is ReferenceCPAttention
        assert attention.q_layernorm is not None and "Identity" not in str(attention.q_layernorm)


def test_sequence_parallel_swaps_every_torch_norm_q_k_included():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(sequence_parallel=True, tensor_model_parallel_size=2)
    ours = hcp_spec.layer_spec(config, backend="reference", own=_deepseek_like_own_spec())
    ref = _local_block(config)
    assert_only_attention_swapped(ref, ours, sequence_parallel=True)
    assert WrappedTorchNorm not in _leaves(ours)
    layer = ours.layer_specs[0].submodules
    assert layer.self_attention.submodules.q_layernorm is SequenceParallelTorchNorm
    assert layer.self_attention.submodules.k_layernorm is SequenceParallelTorchNorm
    assert ours.layer_norm is SequenceParallelTorchNorm
    # without SP the same swap is a difference
    with pytest.raises(AssertionError, match="q_layernorm"):
        assert_only_attention_swapped(ref, ours)


def test_sp_norm_layer_spec_to_block_keeps_q_k_norms():
    """with_sequence_parallel_norms (the project's trainer uses it too) swaps the q/k norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hcp.layers.norm import with_sequence_parallel_norms

    config = _config(num_moe_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None,
                     moe_shared_expert_intermediate_size=None)
    block = with_sequence_parallel_norms(get_gpt_layer_local_spec(qk_layernorm=True), config,
                                         None, 0)
    attention = block.layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm is SequenceParallelTorchNorm
    assert attention.k_layernorm is SequenceParallelTorchNorm
    assert block.layer_norm is SequenceParallelTorchNorm and len(block.layer_specs) == 4


@pytest.mark.parametrize("window, skip, pattern, want", [
    ((31, 0), 2, None, [(31, 0), None, (31, 0), None, (31, 0), None]),          # gpt-oss
    ((31, 0), [1, 1, 0, 0, 1, 0], None, [(31, 0), (31, 0), None, None, (31, 0), None]),
    ((31, 0), None, None, [(31, 0)] * 6),
    (32, None, (5, 1), [(31, 0)] * 5 + [None]),                                  # Gemma 3
    (32, None, None, [(31, 0)] * 6),
    (None, 2, None, [None] * 6),
])
def test_layer_windows(window, skip, pattern, want):
    config = SimpleNamespace(window_size=window, window_attn_skip_freq=skip,
                             interleaved_attn_pattern=pattern)
    assert [hcp_spec.layer_window(config, n) for n in range(1, 7)] == want


def test_planted_difference_is_reported():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    ref = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    old = get_gpt_layer_local_spec(normalization="RMSNorm")  # what the old spec kept
    left = {p.split(".")[-1] for p, _, _ in differences(ref, old)}
    assert {"q_layernorm", "k_layernorm"} <= left and any("mlp" in p for p, _, _ in
                                                           differences(ref, old))
    ours = hcp_spec._with_cp_attention(ref, ReferenceCPAttention)
    assert not differences(ref, ours)
    other = hcp_spec._with_cp_attention(ref, DotProductAttention)  # not the project's attention
    assert differences(hcp_spec._with_cp_attention(ref, ReferenceCPAttention), other)


def test_a_core_attention_of_its_own_is_refused_not_swapped():
    """A family's own attention class (e.g. Gemma 2's softcapping one) is not megatron's: the CP
    attention would drop what it adds, so the spec is refused with the class named."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SoftcapAttention(DotProductAttention):
        pass

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SoftcapAttention
    with pytest.raises(hcp_spec.SpecError, match="SoftcapAttention.*own core attention"):
        hcp_spec._swap_core_attention(spec, ReferenceCPAttention, False)


def test_te_path_keeps_te_subclasses_and_swaps_megatrons_attention():
    """Where TE imports, TE's patched class stands in for megatron's attentions; a family's TE
    subclass (Gemma 3's) is kept - the patch is on the base class it inherits from."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    class PatchedTE:  # stands for TE's class with the te-attention-hcp patch
        pass

    class FamilyTE(PatchedTE):
        pass

    def with_core(cls):
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = cls
        return spec

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    for given, want in ((None, PatchedTE), (FamilyTE, FamilyTE), (PatchedTE, PatchedTE),
                        (ReferenceCPAttention, PatchedTE)):
        spec = get_gpt_layer_local_spec() if given is None else with_core(given)
        assert core(hcp_spec._swap_core_attention(spec, PatchedTE, False)) is want


# ------------------------------------------------------------------ Bridge 0.6.2 (py312)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bridge():
    """Bridge's modules and a one-rank world with megatron's MPU (Bridge's DeepSeek spec and
    megatron's MTP spec read the pipeline rank from it)."""
    if not _bridge.REAL:
        pytest.skip("Megatron-Bridge 0.6.2 needs Python 3.12 (the py312 leg runs these)")
    import torch.distributed as dist
    from megatron.core import parallel_state

    mods = _bridge.load()
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield mods
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()
    _bridge.release()


_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=4, vocab_size=128,
              max_position_embeddings=256)


def _provider(bridge_cls: Any, config: Any) -> Any:
    return bridge_cls().provider_bridge(SimpleNamespace(config=config))


def _llama3():
    import transformers
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    return _provider(LlamaBridge, transformers.LlamaConfig(**_SMALL, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))


def _qwen3():
    import transformers
    from megatron.bridge.models.qwen.qwen3_bridge import Qwen3Bridge

    return _provider(Qwen3Bridge, transformers.Qwen3Config(**_SMALL, head_dim=16))


def _qwen3_moe():
    import transformers
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    return _provider(Qwen3MoEBridge, transformers.Qwen3MoeConfig(
        **_SMALL, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32))


def _deepseek_v3():
    import transformers
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    return _provider(DeepSeekV3Bridge, transformers.DeepseekV3Config(
        **_SMALL, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
        num_nextn_predict_layers=1))


def _gemma3():
    import transformers
    from megatron.bridge.models.gemma.gemma3_bridge import Gemma3ModelBridge

    return _provider(Gemma3ModelBridge, transformers.Gemma3TextConfig(
        **{**_SMALL, "num_hidden_layers": 6}, head_dim=16, sliding_window=32))


def _gpt_oss():
    import transformers
    from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSBridge

    return _provider(GPTOSSBridge, transformers.GptOssConfig(
        **_SMALL, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=32))


def _nemotron_h():
    import transformers
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge

    return _provider(NemotronHBridge, transformers.NemotronHConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, head_dim=16, hybrid_override_pattern="M*M-", mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1))


def _bridge_local(provider: Any) -> Any:
    """Bridge's own spec without TE (its providers' default cannot build a layer here)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    return local_layer_spec(provider)


def _own_without_te(provider: Any) -> Any:
    """The family's spec function with use_transformer_engine=False, called as Bridge calls it
    (what its HAVE_TE=False gives on a machine without TE)."""
    own = provider.transformer_layer_spec
    return functools.partial(own, use_transformer_engine=False)(provider, vp_stage=None)


def _own_as_is(provider: Any) -> Any:
    return provider.transformer_layer_spec(provider)


def _own_local(provider: Any) -> Any:
    """A TE-only spec (Gemma 3's) as its local twins: what builds without TE (the translation
    itself is checked module by module in test_te_only_spec_becomes_its_local_twins)."""
    from megatron_hcp.bridge.local_layers import te_spec_to_local

    spec = provider.transformer_layer_spec
    return te_spec_to_local(_own_as_is(provider), provider, vp_stage=None, pp_rank=0,
                            module_names=(spec.__module__,))


# family: (provider, reference, own spec expected of the provider)
FAMILIES = {
    "llama3": (_llama3, _bridge_local, "default_layer_spec"),
    "qwen3": (_qwen3, _bridge_local, "default_layer_spec"),
    "qwen3_moe": (_qwen3_moe, _bridge_local, "default_layer_spec"),
    "deepseek_v3": (_deepseek_v3, _own_without_te, "get_gpt_decoder_block_spec"),
    "gemma3": (_gemma3, _own_local, "gemma3_layer_spec"),
    "gpt_oss": (_gpt_oss, _bridge_local, "default_layer_spec"),
}


def _resolve_as_bridge(provider: Any) -> Any:
    """GPTModelProvider.provide's resolution of transformer_layer_spec (Bridge 0.6.2)."""
    spec = provider.transformer_layer_spec
    if "vp_stage" in inspect.signature(spec).parameters:
        return spec(provider, vp_stage=None)
    return spec(provider)


def _as_block(provider: Any, spec: Any) -> Any:
    """What megatron's TransformerBlock builds from a layer spec or a block spec."""
    from megatron.core.transformer.transformer_block import _get_block_submodules

    return _get_block_submodules(provider, spec, None, 0)


def _hcp(provider: Any, how: str) -> Any:
    if how == "assigned":  # docs: provider.transformer_layer_spec = layer_spec
        provider.transformer_layer_spec = hcp_spec.layer_spec
    else:  # keeps the family bridge's own spec function
        hcp_spec.use_cp_attention(provider)
    return _resolve_as_bridge(provider)




@needs_bridge
@pytest.mark.parametrize("how", ["assigned", "kept"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_family_spec_is_the_providers_own(bridge, family, how, sp):
    build, reference, own_name = FAMILIES[family]
    provider = build()
    assert _name(provider.transformer_layer_spec) == own_name
    ref = _as_block(provider, reference(provider))
    if sp:
        provider.sequence_parallel = True
    ours = _as_block(provider, _hcp(provider, how))
    assert_only_attention_swapped(ref, ours, sequence_parallel=sp)
    _FEATURES[family](provider, ref)  # the reference has the family's features...
    _FEATURES[family](provider, ours)  # ... and so has ours
    for layer in ours.layer_specs:
        core = layer.submodules.self_attention.submodules.core_attention
        assert core in CP_ATTENTION
    if sp:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        assert WrappedTorchNorm not in _leaves(ours)


def _attention(layer: Any) -> Any:
    return layer.submodules.self_attention


def _mlp(layer: Any) -> str:
    return _name(layer.submodules.mlp)


def _is_norm(cls: Any) -> bool:
    return cls is not None and "Identity" not in _name(cls) and "L2Norm" not in _name(cls)


def _check_llama3(provider, block):
    assert provider.num_query_groups == 2 < provider.num_attention_heads  # GQA
    for layer in block.layer_specs:
        assert _name(_attention(layer).module) == "SelfAttention" and _mlp(layer) != "MoELayer"


def _check_qwen3(provider, block):
    for layer in block.layer_specs:
        sub = _attention(layer).submodules
        assert _is_norm(sub.q_layernorm) and _is_norm(sub.k_layernorm)


def _check_qwen3_moe(provider, block):
    _check_qwen3(provider, block)
    assert provider.num_moe_experts == 8 and provider.moe_grouped_gemm
    assert [_mlp(layer) for layer in block.layer_specs] == ["MoELayer"] * 4


def _check_deepseek_v3(provider, block):
    assert provider.moe_layer_freq == [0, 1, 1, 1]
    assert [_mlp(layer) for layer in block.layer_specs] == ["MLP"] + ["MoELayer"] * 3
    for layer in block.layer_specs:
        attention = _attention(layer)
        assert _name(attention.module) == "MLASelfAttention"
        assert _is_norm(attention.submodules.q_layernorm)
        assert _is_norm(attention.submodules.kv_layernorm)
    shared = block.layer_specs[1].submodules.mlp.keywords["submodules"].shared_experts
    assert shared is not None and provider.moe_shared_expert_intermediate_size == 32


def _check_gemma3(provider, block):
    assert provider.window_size == 32 and provider.interleaved_attn_pattern == (5, 1)
    for layer in block.layer_specs:
        assert _name(_attention(layer).module) == "Gemma3SelfAttention"
        assert _is_norm(_attention(layer).submodules.q_layernorm)


def _check_gpt_oss(provider, block):
    assert provider.softmax_type == "learnable" and provider.window_attn_skip_freq == 2
    assert [_mlp(layer) for layer in block.layer_specs] == ["MoELayer"] * 4


_FEATURES = {"llama3": _check_llama3, "qwen3": _check_qwen3, "qwen3_moe": _check_qwen3_moe,
             "deepseek_v3": _check_deepseek_v3, "gemma3": _check_gemma3,
             "gpt_oss": _check_gpt_oss}


@needs_bridge
@pytest.mark.parametrize("family, attention", [
    ("gemma3", hcp_spec.LayerWindowCPAttention), ("gpt_oss", hcp_spec.LayerWindowCPAttention),
    ("llama3", ReferenceCPAttention), ("deepseek_v3", ReferenceCPAttention)])
def test_window_families_get_per_layer_windows(bridge, family, attention):
    provider = FAMILIES[family][0]()
    provider.transformer_layer_spec = hcp_spec.layer_spec
    block = _as_block(provider, _resolve_as_bridge(provider))
    assert {_attention(layer).submodules.core_attention for layer in block.layer_specs} == {
        attention}


@needs_bridge
def test_window_attention_builds_each_layers_window(bridge):
    """gpt-oss (a full-attention layer every 2nd) and Gemma 3 (a global layer every 6th): the
    reference CP attention, built per layer, holds that layer's window."""
    from megatron.core.transformer.enums import AttnMaskType

    for family, want in (("gpt_oss", [(31, 0), None, (31, 0), None]),
                         ("gemma3", [(31, 0)] * 5 + [None])):
        provider = FAMILIES[family][0]()
        provider.perform_initialization = False  # (not finalized: no init method)
        got = [hcp_spec.LayerWindowCPAttention(provider, n, AttnMaskType.causal,
                                               "self").window_size
               for n in range(1, len(want) + 1)]
        assert got == want
        assert provider.window_size in (32, (31, 0))  # the provider's config is not changed


@needs_bridge
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_te_only_spec_becomes_its_local_twins(bridge, sp):
    """Gemma 3's spec, written with Transformer Engine's modules only, without TE: every TE
    module of every layer becomes its local twin (a fused norm becomes the layer's own norm
    before a column-parallel linear), the block's final norm the zero-centred torch norm, the
    core attention the CP attention; nothing else differs (Gemma 3's self-attention, MLP,
    bias-dropout-adds). A TE module with no twin is refused by name."""
    import sys

    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hcp.bridge.local_layers import RowParallelLinearPostNorm, te_spec_to_local

    provider = _gemma3()
    provider.sequence_parallel = sp
    gemma = sys.modules["megatron.bridge.models.gemma.gemma3_provider"]
    te = _as_block(provider, _own_as_is(provider))
    ours = _as_block(provider, _hcp(provider, "assigned"))
    fused, post = gemma.TELayerNormColumnParallelLinear, gemma.TERowParallelLinearLayerNorm
    attention = "self_attention.submodules"
    twins = {"input_layernorm": (IdentityOp, SequenceParallelTorchNorm),
             f"{attention}.linear_qkv": (fused, ColumnParallelLinear),
             f"{attention}.core_attention": (gemma.Gemma3TEDotProductAttention,
                                             hcp_spec.LayerWindowCPAttention),
             f"{attention}.q_layernorm": (gemma.TENorm, SequenceParallelTorchNorm),
             f"{attention}.k_layernorm": (gemma.TENorm, SequenceParallelTorchNorm),
             f"{attention}.linear_proj": (post, RowParallelLinearPostNorm),
             "pre_mlp_layernorm": (IdentityOp, SequenceParallelTorchNorm),
             "mlp.submodules.linear_fc1": (fused, ColumnParallelLinear),
             "mlp.submodules.linear_fc2": (post, RowParallelLinearPostNorm)}
    want = {f"spec.layer_specs[{i}].submodules.{slot}": pair
            for i in range(len(te.layer_specs)) for slot, pair in twins.items()}
    want["spec.layer_norm"] = (te.layer_norm, SequenceParallelTorchNorm)
    found: list = []
    _walk(te, ours, "spec", found)
    assert {path: (a, b) for path, a, b in found} == want
    assert len(te.layer_specs) == 6
    # a TE module the translation has no twin for (a norm-fused linear as an output projection)
    planted = gemma.gemma3_layer_spec(provider)  # a new tree at each call
    planted.submodules.self_attention.submodules.linear_proj = fused
    with pytest.raises(hcp_spec.SpecError, match="linear_proj"):
        te_spec_to_local(planted, provider, vp_stage=None, pp_rank=0,
                         module_names=(gemma.__name__,))
    assert isinstance(planted, ModuleSpec)


@needs_bridge
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_deepseek_v3_mtp_block(bridge, sp):
    """MTP: megatron's MTP block over the reference decoder spec, local backend."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    provider = _deepseek_v3()
    assert provider.mtp_num_layers == 1
    ref = get_gpt_mtp_block_spec(provider, _own_without_te(provider),
                                 use_transformer_engine=False)
    provider.sequence_parallel = sp
    hcp_spec.use_cp_attention(provider)
    ours = hcp_spec.mtp_block_spec(provider)
    assert_only_attention_swapped(ref, ours, sequence_parallel=sp)
    inner = ours.layer_specs[0].submodules.mtp_model_layer
    assert _name(_attention(inner).module) == "MLASelfAttention" and _mlp(inner) == "MoELayer"


@needs_bridge
@pytest.mark.parametrize("how", ["assigned", "kept"])
def test_nemotron_h_hybrid_stack(bridge, how):
    """Nemotron-H (Bridge's HybridModelProvider): Bridge's own stack spec (megatron has it with
    TE layers only, placeholders here) with Mamba, GDN, MLA, MLP / MoE layers and MTP kept; the
    attention layers' core attention swapped. Without TE the kinds of layer whose TE modules
    all have local twins (attention, MLP, MoE, MTP) get them - module by module, as Gemma 3's -
    and the others (Mamba: mamba_ssm's kernels; GDN, MLA, DSA) keep TE's modules."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_hcp.bridge.local_layers import te_spec_to_local

    provider = _nemotron_h()
    assert provider.hybrid_stack_spec is None and provider.hybrid_layer_pattern == "M*M-"
    ref = provider._resolve_hybrid_stack_spec()  # Bridge's own resolution
    if how == "assigned":
        provider.hybrid_stack_spec = hcp_spec.layer_spec
    else:
        hcp_spec.use_cp_attention(provider)
    ours = provider._resolve_hybrid_stack_spec()
    local = te_spec_to_local(ref, provider, vp_stage=None, pp_rank=0)
    assert_only_attention_swapped(local, ours)
    found: list = []
    _walk(ref, ours, "spec", found)
    twins = {ColumnParallelLinear, RowParallelLinear, SequenceParallelTorchNorm}
    changed = {path.split(".")[2] for path, a, b in found
               if not path.endswith("core_attention")}
    assert changed == {"attention_layer", "mlp_layer", "moe_layer", "mtp_block_spec"}
    for path, a, b in found:
        if path.endswith("core_attention"):
            assert b is ReferenceCPAttention, path
        elif a is IdentityOp:  # a fused norm split out into the layer
            assert b is SequenceParallelTorchNorm and path.endswith("layernorm"), path
        else:
            assert b in twins and type(a).__name__ in ("MagicMock", "type"), (path, a, b)
    sub = ours.submodules
    # the Mamba layer is not among the changed ones: its mixer keeps TE's modules (mamba_ssm)
    assert _name(sub.mamba_layer.submodules.mixer.module) == "MambaMixer"
    assert _attention(sub.attention_layer).submodules.core_attention is ReferenceCPAttention
    assert _attention(sub.mla_layer).submodules.core_attention is ReferenceCPAttention
    assert ours.submodules.mtp_block_spec is not None


@needs_bridge
def test_nemotron_h_mamba_layers_need_mamba_ssm(bridge, monkeypatch):
    """Nemotron-H through Bridge's recipe and provide() on one CPU rank: a pattern of the
    hybrid's attention and MLP layers builds (its final norm a torch norm with
    ``hybrid-final-norm-without-te``; without it TE's, which cannot build here); a pattern with
    Mamba layers stops at build with megatron's own ImportError naming mamba_ssm (the kernels
    of its MambaMixer), not with a TE placeholder's error."""
    import torch

    from megatron_hcp.patching.hybrid import HYBRID_PATCHES
    from megatron_hcp.patching.registry import apply, revert

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # RoPE's tables
    patches = [p for p in HYBRID_PATCHES if p.supports()]
    assert patches, "hybrid-final-norm-without-te is written for this megatron-core"
    with pytest.raises(Exception, match="TENorm|transformer_engine|Transformer Engine"):
        _nemotron_h_model("*-*-")
    apply(patches)
    try:
        model = _nemotron_h_model("*-*-")
        with pytest.raises(ImportError, match="MambaSSM is not installed"):
            _nemotron_h_model("M*M-")
    finally:
        revert(patches)
    assert isinstance(model.decoder.final_norm, torch.nn.RMSNorm)
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["TransformerLayer", "MLPLayer"] * 2
    assert isinstance(model.decoder.layers[0].self_attention.core_attention,
                      ReferenceCPAttention)


def _nemotron_h_model(pattern: str) -> Any:
    """Bridge's Nemotron-H 4B recipe's provider, tiny, with ``pattern``, built on this rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.unit.bridge._families import tiny_direct_recipe

    provider = _cpu_ready(tiny_direct_recipe("nemotron_h", hybrid_layer_pattern=pattern).model,
                          "nemotron_h")
    hcp_spec.use_cp_attention(provider, backend="reference")
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider.provide()


@needs_bridge
def test_old_spec_fails_the_comparison(bridge):
    """The planted difference: the spec megatron-hcp offered before 4d50598 (megatron's local spec
    with only multi_latent_attention passed on) loses Qwen3-MoE's q/k norms and experts."""
    from megatron_hcp.attention.module import gpt_layer_spec

    provider = _qwen3_moe()
    ref = _as_block(provider, _bridge_local(provider))
    old = _as_block(provider, gpt_layer_spec("reference"))
    with pytest.raises(AssertionError) as err:
        assert_only_attention_swapped(ref, old)
    for lost in ("q_layernorm", "k_layernorm", ".mlp"):
        assert lost in str(err.value)
    provider.transformer_layer_spec = hcp_spec.layer_spec
    assert_only_attention_swapped(ref, _as_block(provider, _resolve_as_bridge(provider)))


@needs_bridge
def test_gemma2_own_attention_is_refused(bridge):
    """Gemma 2's spec carries its own attention (logit softcapping): refused by name."""
    from megatron.bridge.models.gemma.gemma2_provider import Gemma2ModelProvider

    provider = Gemma2ModelProvider(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                   num_attention_heads=4, num_query_groups=2, kv_channels=16,
                                   vocab_size=128, seq_length=64)
    provider.transformer_layer_spec = hcp_spec.layer_spec
    with pytest.raises(hcp_spec.SpecError, match="Gemma2"):
        _resolve_as_bridge(provider)


def _cpu_ready(provider: Any, family: str) -> Any:
    """What megatron needs to build on CPU, none of it about the spec: CPU initialization, no
    fused kernels, fp32, the allgather MoE dispatcher (alltoall opens a CUDA stream); no MTP
    (Bridge's MTP block is TE's always)."""
    import torch

    for name in ("moe_permute_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
                 "persist_layer_norm", "bias_activation_fusion", "bias_dropout_fusion",
                 "masked_softmax_fusion", "cross_entropy_loss_fusion",
                 "moe_shared_expert_overlap"):
        setattr(provider, name, False)
    provider.bf16, provider.params_dtype = False, torch.float32
    provider.autocast_dtype = torch.float32
    provider.use_cpu_initialization = True
    provider.moe_token_dispatcher_type = "allgather"
    provider.mtp_num_layers = None
    return provider


@needs_bridge
@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bridge_builds_the_model_with_the_features(bridge, family, monkeypatch):
    """Bridge's own provide() builds the model from the spec (one CPU rank): the family's q/k
    norms, experts, shared experts, MLA and sinks are modules of the model, beside the CP
    attention. (megatron makes MLA's and YaRN's RoPE tables on torch.cuda.current_device()
    whatever use_cpu_initialization says: the CPU is that device here.)"""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")

    provider = _cpu_ready(FAMILIES[family][0](), family)
    provider.transformer_layer_spec = hcp_spec.layer_spec
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    layers = list(model.decoder.layers)
    assert len(layers) == 4
    cores = [layer.self_attention.core_attention for layer in layers]
    assert all(isinstance(core, ReferenceCPAttention) for core in cores)
    kinds = [type(layer.mlp).__name__ for layer in layers]
    if family in ("qwen3", "qwen3_moe"):
        for layer in layers:
            assert isinstance(layer.self_attention.q_layernorm, torch.nn.RMSNorm)
            assert isinstance(layer.self_attention.k_layernorm, torch.nn.RMSNorm)
    if family in ("qwen3_moe", "gpt_oss"):
        assert kinds == ["MoELayer"] * 4
        assert all(layer.mlp.experts.num_local_experts == 8 for layer in layers)
    if family == "deepseek_v3":
        assert kinds == ["MLP"] + ["MoELayer"] * 3
        assert all(layer.mlp.shared_experts is not None for layer in layers[1:])
        assert {type(layer.self_attention).__name__ for layer in layers} == {
            "MLASelfAttention"}
        assert isinstance(layers[0].self_attention.kv_layernorm, torch.nn.RMSNorm)
    if family == "gpt_oss":
        assert [core.window_size for core in cores] == [(31, 0), None, (31, 0), None]
        assert all(isinstance(core.softmax_offset, torch.nn.Parameter) for core in cores)
    if family == "llama3":
        assert kinds == ["MLP"] * 4
        assert layers[0].self_attention.q_layernorm is None


@needs_bridge
def test_bridge_mtp_block_needs_te(bridge):
    """Bridge's provide() asks megatron for TE's MTP block always (use_transformer_engine=True),
    which does not build without TE - with or without megatron-hcp. mtp_block_spec is the block
    on the local backend."""
    provider = _deepseek_v3()
    provider.transformer_layer_spec = hcp_spec.layer_spec
    assert provider.mtp_num_layers == 1
    from megatron.bridge.models.gpt_provider import mtp_block_spec

    with pytest.raises(TypeError, match="not callable"):
        mtp_block_spec(provider)
    assert hcp_spec.mtp_block_spec(provider) is not None


@needs_bridge
@pytest.mark.parametrize("how", ["assigned", "kept"])
def test_the_mtp_patch_gives_bridge_megatron_hcps_mtp_block(bridge, how, monkeypatch):
    """``bridge-mtp-block-spec-local``: for a provider on megatron-hcp's spec (layer_spec
    assigned, or use_cp_attention) Bridge's own mtp_block_spec gives megatron's MTP block on the
    local backend with the CP attention, and Bridge's provide() builds DeepSeek-V3 with its MTP
    layer on one CPU rank; without the patch both raise (TE's block). A provider on its own spec
    still gets Bridge's function."""
    import torch
    from megatron.bridge.models import gpt_provider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hcp.bridge.mtp import BRIDGE_MTP_PATCHES
    from megatron_hcp.patching.registry import apply, revert

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # MLA's / YaRN's tables

    def on_hcp_spec(provider):
        if how == "assigned":
            provider.transformer_layer_spec = hcp_spec.layer_spec
        else:
            hcp_spec.use_cp_attention(provider)
        return provider

    def mtp_provider():
        provider = _cpu_ready(_deepseek_v3(), "deepseek_v3")
        provider.mtp_num_layers = 1
        return provider

    own = mtp_provider()
    ref = get_gpt_mtp_block_spec(own, _own_without_te(own), use_transformer_engine=False)
    provider = on_hcp_spec(mtp_provider())
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(TypeError, match="not callable"):
        provider.provide()
    patch = BRIDGE_MTP_PATCHES[:1]
    assert patch[0].name == "bridge-mtp-block-spec-local"
    apply(patch)
    try:
        assert_only_attention_swapped(ref, gpt_provider.mtp_block_spec(provider))
        with pytest.raises(TypeError, match="not callable"):
            gpt_provider.mtp_block_spec(own)  # its own spec: Bridge's function
        model = provider.provide()
    finally:
        revert(patch)
    inner = model.mtp.layers[0].mtp_model_layer
    assert type(inner.self_attention).__name__ == "MLASelfAttention"
    assert isinstance(inner.self_attention.core_attention, ReferenceCPAttention)
    assert type(inner.mlp).__name__ == "MoELayer" and inner.mlp.shared_experts is not None
