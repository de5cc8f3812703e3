"""The CPU Gemma 3 that megatron-hcp's spec builds from Bridge's Gemma 3 spec IS Gemma 3.

Oracle: Hugging Face's ``Gemma3ForCausalLM`` (eager attention, fp32) with random weights - its
norms' weights randomised too (HF starts them at zero), so the zero-centred gains ``1 + w`` are
exercised. The same ``Gemma3TextConfig`` goes through Bridge's own ``AutoBridge`` ->
``Gemma3ModelBridge`` -> ``Gemma3ModelProvider`` with ``megatron_hcp.bridge.spec.layer_spec``
(Transformer Engine is absent: Bridge's TE-only ``gemma3_layer_spec`` becomes its local twins,
:mod:`megatron_hcp.bridge.local_layers`, with the per-layer-window CP attention), built on one CPU
rank by Bridge's ``provide()``; the HF weights are loaded by Bridge's own loader
(``AutoBridge.load_hf_weights``: its QKV / gated-MLP mappings, and the registry's aliases
``input_layernorm`` / ``pre_mlp_layernorm`` for TE's fused-norm weight names).

The config makes each Gemma 3 feature matter: 6 layers (5 sliding-window layers, then a global
one), an 8-token window on 32-token sequences, GQA (4 heads / 2 KV heads), q/k norms, post-attention
/ post-MLP norms, a non-default ``query_pre_attn_scalar`` (softmax scale) and non-default local
and global RoPE bases. The embeddings, every layer's output and the logits must equal HF's
(fp32, 1e-5 of the logits' scale). The comparison fails on a planted mistake: RoPE bases
swapped, gains not zero-centred, the default softmax scale, the window one token short, no
global layer.

Also: :class:`~megatron_hcp.layers.norm.ZeroCenteredGammaNorm` against HF's ``Gemma3RMSNorm``, and
:class:`~megatron_hcp.bridge.local_layers.RowParallelLinearPostNorm` = the linear, then the norm.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from . import _bridge

needs_bridge = pytest.mark.skipif(not _bridge.REAL, reason="Megatron-Bridge 0.6.2 needs "
                                  "Python 3.12 (the py312 leg runs these)")

SEQ, BATCH, VOCAB = 32, 2, 128
RTOL = 1e-5  # of the logits' (hidden states') largest magnitude
LOCAL_BASE, GLOBAL_BASE = 300.0, 5000.0  # Gemma 3's defaults: 10k, 1M


# ------------------------------------------------------------------ one CPU rank
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world with megatron's MPU (megatron's parallel linears read it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bridge(world):
    """Bridge's modules (with the import-only TE shim); megatron makes the RoPE tables on
    ``torch.cuda.current_device()`` whatever ``use_cpu_initialization`` says: the CPU here."""
    if not _bridge.REAL:
        pytest.skip("Megatron-Bridge 0.6.2 needs Python 3.12 (the py312 leg runs these)")
    mods = _bridge.load()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        # megatron's LanguageModule sets TE's backend switches in the process environment when
        # it builds a model and asserts them on the next build (language_module.py:111-142):
        # any earlier in-process GPT of the default 'auto' backend leaves all three at 1, and
        # Gemma 3 asks for the flash backend
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            patch.delenv(name, raising=False)
        yield mods
    _bridge.release()


# ------------------------------------------------------------------ the two models
def _hf_config() -> Any:
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        query_pre_attn_scalar=24, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_BASE},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_BASE}},
        final_logit_softcapping=None, attn_logit_softcapping=None,
        attn_implementation="eager", dtype=torch.float32,
        architectures=["Gemma3ForCausalLM"])


@pytest.fixture(scope="module")
def gemma3(bridge):
    """HF's Gemma 3 (random weights, norms' too), Bridge's AutoBridge holding it, a batch."""
    import transformers
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    config = _hf_config()
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    torch.manual_seed(1234)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:  # HF starts them at 0: gain 1 whether zero-centred or not
                param.normal_(0.0, 0.5)
    pretrained = PreTrainedCausalLM(device="cpu")
    pretrained.config = config
    pretrained.model = hf
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return SimpleNamespace(hf=hf, auto=AutoBridge(pretrained), ids=ids)


def _megatron(gemma3: Any, **mistake: Any) -> Any:
    """megatron's Gemma 3 from Bridge's provider with megatron-hcp's spec, one CPU rank, the HF
    weights loaded by Bridge's loader. ``mistake``: provider fields set wrong on purpose."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hcp.bridge import spec as hcp_spec

    from .test_bridge_spec import _cpu_ready

    provider = gemma3.auto.to_megatron_provider(load_weights=False)
    assert type(provider).__name__ == "Gemma3ModelProvider"
    if not mistake:  # what Bridge read from the HF config
        assert provider.rotary_base == (LOCAL_BASE, GLOBAL_BASE)
        assert provider.window_size == 8 and provider.interleaved_attn_pattern == (5, 1)
        assert provider.softmax_scale == pytest.approx(24 ** -0.5)
        assert provider.layernorm_zero_centered_gamma
    _cpu_ready(provider, "gemma3")
    provider.seq_length = SEQ
    provider.transformer_layer_spec = hcp_spec.layer_spec
    for name, value in mistake.items():
        setattr(provider, name, value)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide().eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gemma3.auto.load_hf_weights([model])
    unset = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert not unset, f"Bridge's loader set no HF weight into {unset}"
    return model


def _run(model: Any, ids: torch.Tensor, layers: Any, embedding: Any,
         seq_first: bool) -> dict[str, torch.Tensor]:
    """Logits, embeddings and each layer's output (batch first) of one forward."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen[name] = (out.transpose(0, 1) if seq_first else out).detach().clone()
        return hook

    handles = [embedding.register_forward_hook(keep("embedding"))]
    handles += [layer.register_forward_hook(keep(f"layer {i}")) for i, layer in enumerate(layers)]
    try:  # megatron's fused activation (jit_fuser: torch.compile) eager: inductor would start
        # compile workers (processes) and the CPU has nothing to fuse
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            if seq_first:
                positions = torch.arange(SEQ).unsqueeze(0).expand(ids.shape[0], -1)
                logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
            else:
                logits = model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    seen["logits"] = logits.detach()
    return seen


def _hf_outputs(gemma3: Any) -> dict[str, torch.Tensor]:
    hf = gemma3.hf
    return _run(hf, gemma3.ids, hf.model.layers, hf.model.embed_tokens, seq_first=False)


def _megatron_outputs(gemma3: Any, model: Any) -> dict[str, torch.Tensor]:
    return _run(model, gemma3.ids, model.decoder.layers, model.embedding, seq_first=True)


def _relative_differences(ref: dict, ours: dict) -> dict[str, float]:
    assert set(ref) == set(ours)
    return {k: ((ours[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}


@needs_bridge
def test_cpu_gemma3_is_hf_gemma3(gemma3):
    """Embeddings, each layer (first the five windowed ones, then the global one) and the
    logits equal HF's; the first that differs names the module to look at."""
    from megatron_hcp.bridge.local_layers import RowParallelLinearPostNorm
    from megatron_hcp.bridge.spec import LayerWindowCPAttention
    from megatron_hcp.layers.norm import ZeroCenteredGammaNorm

    model = _megatron(gemma3)
    layers = list(model.decoder.layers)
    assert [layer.self_attention.core_attention.window_size for layer in layers] == (
        [(7, 0)] * 5 + [None])
    for layer in layers:
        assert isinstance(layer.self_attention.core_attention, LayerWindowCPAttention)
        assert isinstance(layer.input_layernorm, ZeroCenteredGammaNorm)
        assert isinstance(layer.pre_mlp_layernorm, ZeroCenteredGammaNorm)
        assert isinstance(layer.self_attention.q_layernorm, ZeroCenteredGammaNorm)
        for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
            assert type(linear).__name__ == RowParallelLinearPostNorm.__name__
            assert isinstance(linear.post_layernorm, ZeroCenteredGammaNorm)
    assert isinstance(model.decoder.final_layernorm, ZeroCenteredGammaNorm)

    ref = _hf_outputs(gemma3)
    ours = _megatron_outputs(gemma3, model)
    assert ours["logits"].shape == ref["logits"].shape == (BATCH, SEQ, VOCAB)
    diffs = _relative_differences(ref, ours)
    print(f"\nGemma 3 oracle, max |megatron - HF| / max |HF|: {diffs}; logits: max abs "
          f"{(ours['logits'] - ref['logits']).abs().max().item():.3e} "
          f"(scale {ref['logits'].abs().max().item():.3f})")
    order = ["embedding", *(f"layer {i}" for i in range(len(layers))), "logits"]
    first = next((k for k in order if diffs[k] > RTOL), None)
    assert first is None, f"differs from HF's Gemma 3 first at {first}: {diffs}"


@needs_bridge
@pytest.mark.parametrize("name, mistake", [
    ("rope bases swapped", {"rotary_base": (GLOBAL_BASE, LOCAL_BASE)}),
    ("gain not zero-centred", {"layernorm_zero_centered_gamma": False}),
    ("default softmax scale", {"softmax_scale": None}),
    ("window one token short", {"window_size": 7}),
    ("no global layer", {"interleaved_attn_pattern": (6, 1)}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_oracle_sees_a_planted_mistake(gemma3, name, mistake):
    """The same comparison with one thing wrong differs clearly (>= 1% of the logits' scale)."""
    ref = _hf_outputs(gemma3)
    ours = _megatron_outputs(gemma3, _megatron(gemma3, **mistake))
    diff = _relative_differences(ref, ours)["logits"]
    print(f"\n{name}: max |megatron - HF| / max |HF| of the logits = {diff:.3g}")
    assert diff > 1e-2, (name, diff)


# ------------------------------------------------------------------ the modules, one by one
def test_zero_centred_norm_is_gemma3s_rmsnorm():
    """The norm built under ``layernorm_zero_centered_gamma`` is HF's Gemma3RMSNorm (gain
    ``1 + w``); torch's RMSNorm with the same stored weight is not."""
    gemma3_modeling = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    from megatron_hcp.layers.norm import SequenceParallelTorchNorm, ZeroCenteredGammaNorm

    config = SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=True,
                             sequence_parallel=False)
    ours = SequenceParallelTorchNorm(config, 64, eps=1e-6)
    assert isinstance(ours, ZeroCenteredGammaNorm)
    assert torch.equal(ours.weight, torch.zeros(64)) and ours.bias is None  # gain 1 at start
    hf = gemma3_modeling.Gemma3RMSNorm(64, eps=1e-6)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, generator=generator) * 0.5
    x = torch.randn(2, 5, 64, generator=generator) * 3.0
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-6, atol=1e-6)
        plain = torch.nn.RMSNorm(64, eps=1e-6)
        plain.weight.copy_(weight)
        assert (plain(x) - hf(x)).abs().max() > 0.1


def test_zero_centred_layernorm_gain_is_one_plus_weight():
    from megatron_hcp.layers.norm import ZeroCenteredGammaNorm

    norm = ZeroCenteredGammaNorm("LayerNorm", 16, eps=1e-5)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, generator=generator)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=generator))
        norm.bias.copy_(torch.randn(16, generator=generator))
        want = torch.nn.functional.layer_norm(x, (16,), 1 + norm.weight, norm.bias, 1e-5)
        torch.testing.assert_close(norm(x), want)


def test_row_parallel_linear_post_norm_is_the_linear_then_the_norm(world):
    """One rank: the output is the norm (zero-centred RMSNorm, the config's epsilon) of the row-
    parallel linear's output, no bias; a biased linear is refused."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hcp.bridge.local_layers import RowParallelLinearPostNorm
    from megatron_hcp.layers.norm import ZeroCenteredGammaNorm

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               normalization="RMSNorm", layernorm_zero_centered_gamma=True,
                               layernorm_epsilon=1e-6, add_bias_linear=False,
                               use_cpu_initialization=True)
    kwargs = dict(config=config, init_method=config.output_layer_init_method,
                  input_is_parallel=True, skip_bias_add=True)
    layer = RowParallelLinearPostNorm(128, 64, bias=False, **kwargs)
    assert type(layer).__name__ == "RowParallelLinearPostNorm"
    assert isinstance(layer.post_layernorm, ZeroCenteredGammaNorm)
    assert layer.post_layernorm.eps == 1e-6
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, 2, 128, generator=generator)
    with torch.no_grad():
        layer.post_layernorm.weight.copy_(torch.randn(64, generator=generator) * 0.5)
        out, bias = layer(x)
        linear = x @ layer.weight.t()
        want = torch.nn.functional.rms_norm(linear, (64,), 1 + layer.post_layernorm.weight,
                                            1e-6)
    assert bias is None
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out, layer.post_layernorm(linear))
    biased = RowParallelLinearPostNorm(128, 64, bias=True, **kwargs)
    with pytest.raises(ValueError, match="add_bias_linear"):
        biased(x)
