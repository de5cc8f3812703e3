"""The spec a Megatron-Bridge provider builds, with megatron-hcp's CP attention in it.

``provider.transformer_layer_spec = megatron_hcp.bridge.spec.layer_spec`` (hybrid providers:
``provider.hybrid_stack_spec = ...``), or ``megatron_hcp.bridge.spec.use_cp_attention(provider)``,
which keeps the spec function a family bridge gave the provider (DeepSeek's block spec). Bridge
calls it as it calls any spec function: with the provider and, under virtual pipelining, the
``vp_stage``.

What it returns is the provider's own spec - what Bridge builds for that provider without
megatron-hcp, every feature of its config kept (MoE layers and their per-layer pattern
``moe_layer_freq``, grouped GEMM, shared experts, MLA, q/k layernorm, windows, ``softmax_type``,
Mamba layers of hybrid providers) - with two changes only:

* **core attention**: megatron-hcp's CP attention. Where Transformer Engine imports, megatron's
  ``TEDotProductAttention`` with the ``te-attention-hcp`` patch (a family's subclass of it, such
  as Gemma 3's, is kept: the patch is on the base class); else
  :class:`~megatron_hcp.attention.module.ReferenceCPAttention`, or :class:`LayerWindowCPAttention`
  where windows differ per layer (``window_attn_skip_freq``, Gemma 3's ``window_size=W`` with
  ``interleaved_attn_pattern``). A core attention of a family's own that adds more than that
  (Gemma 2's softcapping one) is refused (:class:`SpecError`), never silently replaced; an
  experimental variant's attention spec (DSA) is left as it is.
* **norms under sequence parallelism**: megatron's CPU norm (``WrappedTorchNorm``) refuses SP;
  every one of them - input / pre-MLP norms, q/k (MLA: q/kv) layernorms, the block's final norm -
  becomes :class:`~megatron_hcp.layers.norm.SequenceParallelTorchNorm` (TE's norms take SP as they
  are).

Which spec is "the provider's own": the provider's ``transformer_layer_spec`` (hybrid providers:
``hybrid_stack_spec``) as Bridge would call it; where that is this function, the provider class's
default. Without Transformer Engine, Bridge's TE spec functions cannot build a layer; megatron's
local spec is then built from the provider's config with the provider's own arguments:

* Bridge's ``default_layer_spec`` / ``transformer_engine_layer_spec`` / ``local_layer_spec`` ->
  megatron's ``get_gpt_decoder_block_spec(provider, use_transformer_engine=False,
  normalization=provider.normalization, qk_l2_norm=provider.qk_l2_norm)`` for this pipeline stage
  (per-layer MoE / dense pattern, MLA and q/k norms from the config);
* a spec function taking ``use_transformer_engine`` (the ``partial(get_gpt_decoder_block_spec,
  use_transformer_engine=HAVE_TE)`` of the DeepSeek, GLM, ... bridges) -> that function with
  ``use_transformer_engine=False``;
* anything else (a ``ModuleSpec``, Gemma 3's ``gemma3_layer_spec``) -> called as Bridge calls
  it; where TE does not import, its TE modules become megatron's local twins
  (:func:`~megatron_hcp.bridge.local_layers.te_spec_to_local`: Gemma 3 builds on a CPU);
* a hybrid stack spec (Nemotron-H), which megatron has only with TE layers -> called as Bridge
  calls it; where TE does not import, its attention and MLP layers get their local twins (the
  other kinds - Mamba, whose mixer needs mamba_ssm's kernels, GDN, MLA, DSA, MoE - keep TE's
  modules and build only where TE imports).

Multi-token prediction: Bridge's ``provide`` builds the MTP block over this spec's last layer
(the CP attention comes with it) with TE's modules always, which needs TE;
:func:`mtp_block_spec` is the same block with the backend of this spec.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from ..attention.module import ReferenceCPAttention, core_attention_class
from ..attention.te import have_te
from ..layers.norm import map_spec, torch_norms_to_sp, uses_torch_norms
from .local_layers import te_spec_to_local
from .spec_error import SpecError

__all__ = ["LayerWindowCPAttention", "SpecError", "layer_spec", "layer_window",
           "mtp_block_spec", "own_spec", "use_cp_attention"]

# Bridge's gpt_provider spec functions that megatron's local decoder-block spec replaces
_BRIDGE_DEFAULT_SPECS = ("default_layer_spec", "transformer_engine_layer_spec",
                         "local_layer_spec", "transformer_engine_full_layer_spec")


# ------------------------------------------------------------------- per-layer windows
def layer_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """The window megatron / Bridge give layer ``layer_number`` (1-based) of ``config``:
    megatron's ``window_size`` with ``window_attn_skip_freq`` (a full-attention layer every N,
    or a per-layer list), or Bridge's Gemma 3 form - ``window_size=W`` tokens, ``(W-1, 0)`` on
    the sliding-window layers, a global layer every ``sum(interleaved_attn_pattern)``."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        pattern = getattr(config, "interleaved_attn_pattern", None)
        if pattern is not None and layer_number % sum(pattern) == 0:
            return None
        return (window - 1, 0)
    if not is_layer_window_attention(tuple(window), getattr(config, "window_attn_skip_freq",
                                                            None), layer_number):
        return None
    return tuple(window)


def _per_layer_windows(config: Any) -> bool:
    window = getattr(config, "window_size", None)
    return window is not None and (
        (isinstance(window, int) and not isinstance(window, bool))
        or getattr(config, "window_attn_skip_freq", None) is not None)


class LayerWindowCPAttention(ReferenceCPAttention):
    """:class:`ReferenceCPAttention` with this layer's window (:func:`layer_window`): the
    reference attention applies one ``window_size`` to every layer, so each layer gets a copy of
    the config holding its own."""

    def __init__(self, config, layer_number: int, *args: Any, **kwargs: Any):
        config = copy.copy(config)  # shallow: the process groups it may hold are shared
        window = layer_window(config, layer_number)
        config.window_size = None if window is None else tuple(window)
        config.window_attn_skip_freq = None
        super().__init__(config, layer_number, *args, **kwargs)


# ------------------------------------------------------------------- the provider's own spec
def _is_ours(spec: Any) -> bool:
    while isinstance(spec, functools.partial):
        spec = spec.func
    return spec is layer_spec


def _hybrid(provider: Any) -> bool:
    return is_dataclass(provider) and any(f.name == "hybrid_stack_spec" for f in fields(provider))


def _spec_field(provider: Any) -> str:
    return "hybrid_stack_spec" if _hybrid(provider) else "transformer_layer_spec"


def own_spec(provider: Any) -> Any:
    """The spec (or spec function) ``provider`` builds without megatron-hcp: its
    ``transformer_layer_spec`` (hybrid: ``hybrid_stack_spec``), or its class's default where
    that is :func:`layer_spec`. ``None`` for a hybrid provider is Bridge's default stack spec."""
    name = _spec_field(provider)
    current = getattr(provider, name, None)
    if not _is_ours(current):
        return current
    field = next((f for f in fields(type(provider)) if f.name == name), None)
    if field is None:
        return None
    if field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not MISSING else None


def _call_as_bridge(provider: Any, spec: Any, vp_stage: int | None, **extra: Any) -> Any:
    """``spec`` resolved as Bridge resolves it: a ``ModuleSpec`` as it is; a GPT spec function
    with the provider (and ``vp_stage`` where it takes one); a hybrid one with the provider
    where it takes an argument (``None``: Bridge's default hybrid stack spec)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return spec
    params = inspect.signature(spec).parameters if spec is not None else {}
    if _hybrid(provider):
        if spec is None:
            from megatron.bridge.models.hybrid.hybrid_provider import (
                get_default_hybrid_stack_spec,
            )

            return get_default_hybrid_stack_spec(provider)
        return spec(provider) if len(params) > 0 else spec()
    kwargs = {k: v for k, v in extra.items() if k in params}
    if "vp_stage" in params:
        kwargs["vp_stage"] = vp_stage
    return spec(provider, **kwargs)


def _bridge_default(spec: Any) -> bool:
    return (getattr(spec, "__module__", None) == "megatron.bridge.models.gpt_provider"
            and getattr(spec, "__name__", None) in _BRIDGE_DEFAULT_SPECS)


def _takes_te_switch(spec: Any) -> bool:
    if isinstance(spec, functools.partial) and "use_transformer_engine" in spec.keywords:
        return True
    try:
        return callable(spec) and "use_transformer_engine" in inspect.signature(spec).parameters
    except (TypeError, ValueError):
        return False


def _pp_rank(provider: Any) -> int | None:
    """This pipeline rank from Bridge's process-group collection (the decentralized path has no
    MPU globals); 0 without pipelining; None: megatron's MPU."""
    pgc = getattr(provider, "_pg_collection", None)
    if pgc is not None and getattr(pgc, "pp", None) is not None:
        return pgc.pp.rank()
    if getattr(provider, "pipeline_model_parallel_size", 1) == 1:
        return 0
    return None


def _local_spec(provider: Any, spec: Any, vp_stage: int | None) -> Any:
    """The provider's own spec with megatron's local (non-TE) modules."""
    if _hybrid(provider):  # megatron has it with TE layers only: its attention / MLP layers'
        built = _call_as_bridge(provider, spec, vp_stage)  # local twins where TE is absent
        return built if have_te() else te_spec_to_local(
            built, provider, vp_stage=vp_stage, pp_rank=None, module_names=_defined_in(spec))
    pp_rank = _pp_rank(provider)
    if _bridge_default(spec):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            provider, use_transformer_engine=False, normalization=provider.normalization,
            qk_l2_norm=getattr(provider, "qk_l2_norm", False), vp_stage=vp_stage,
            pp_rank=pp_rank)
    if _takes_te_switch(spec):
        return _call_as_bridge(provider, functools.partial(spec, use_transformer_engine=False),
                               vp_stage, pp_rank=pp_rank)
    built = _call_as_bridge(provider, spec, vp_stage)
    if have_te():
        return built
    # a spec written with TE's modules only (Gemma 3's): megatron's local twins of them
    return te_spec_to_local(built, provider, vp_stage=vp_stage, pp_rank=pp_rank,
                            module_names=_defined_in(spec))


def _defined_in(spec: Any) -> tuple[str, ...]:
    """The module a spec function (under any ``functools.partial``) was written in."""
    while isinstance(spec, functools.partial):
        spec = spec.func
    module = getattr(spec, "__module__", None)
    return (module,) if isinstance(module, str) else ()


# ------------------------------------------------------------------- the swap
def _plain_attention() -> tuple[Any, ...]:
    """megatron's own core attentions, which the CP attention replaces as they are: the local
    ``DotProductAttention`` and ``TEDotProductAttention`` (a placeholder where TE is absent)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return (DotProductAttention, getattr(te_ext, "TEDotProductAttention", DotProductAttention))


def _gemma3_attention() -> Any:
    """Bridge's Gemma 3 core attention, where its module was imported: TE's attention with
    per-layer windows only (what :class:`LayerWindowCPAttention` does)."""
    import sys

    module = sys.modules.get("megatron.bridge.models.gemma.gemma3_provider")
    return getattr(module, "Gemma3TEDotProductAttention", None)


def _te_subclass(te_class: Any, cls: Any) -> bool:
    try:
        return isinstance(cls, type) and isinstance(te_class, type) and issubclass(cls, te_class)
    except TypeError:
        return False


def _swap_core_attention(spec: Any, attention: Any, per_layer_windows: bool) -> Any:
    """``spec`` with megatron-hcp's CP attention in every ``core_attention`` slot holding a class
    (an experimental variant's own attention ``ModuleSpec`` - DSA - is kept as it is).

    ``attention``: :class:`ReferenceCPAttention` (megatron's attentions and Gemma 3's become it,
    or :class:`LayerWindowCPAttention` with per-layer windows) or TE's patched class (its
    subclasses are kept: they inherit the patch). Any other class adds behaviour the CP attention
    does not have (e.g. Gemma 2's logit softcapping): :class:`SpecError`, never a silent swap."""
    plain, gemma3 = _plain_attention(), _gemma3_attention()
    reference = attention is ReferenceCPAttention
    mine = (ReferenceCPAttention, LayerWindowCPAttention)

    def swap(path: tuple[str, ...], value: Any) -> Any:
        if not path or path[-1] != "core_attention" or value is None:
            return value
        if not reference and (value is attention or _te_subclass(attention, value)):
            return value
        if value in mine or any(value is p for p in plain):
            return LayerWindowCPAttention if reference and per_layer_windows else attention
        if gemma3 is not None and value is gemma3:
            return LayerWindowCPAttention if reference else attention
        raise SpecError(
            f"{'.'.join(path)}={value!r}: the provider's spec has its own core attention, which "
            "megatron-hcp's CP attention does not reproduce; train this provider with its own "
            "spec (without megatron_hcp.bridge.spec.layer_spec)")

    return map_spec(spec, swap)


def _with_cp_attention(spec: Any, attention: Any) -> Any:
    """``spec`` with ``attention`` in every ``core_attention`` slot that holds a class."""
    return map_spec(spec, lambda path, value: attention if (
        path and path[-1] == "core_attention" and value is not None) else value)


def layer_spec(provider: Any, vp_stage: int | None = None, *, backend: str = "auto",
               own: Any = ...) -> Any:
    """``provider``'s own spec (:func:`own_spec`, or ``own``) for pipeline stage ``vp_stage``
    with megatron-hcp's CP attention and, under sequence parallelism, SP-capable torch norms
    (module docstring). ``backend``: ``auto`` (TE where it imports), ``te`` or ``reference``."""
    spec = own_spec(provider) if own is ... else own
    attention = core_attention_class(backend)
    if attention is ReferenceCPAttention:
        built = _local_spec(provider, spec, vp_stage)
    else:
        built = _call_as_bridge(provider, spec, vp_stage)
    built = _swap_core_attention(built, attention, _per_layer_windows(provider))
    if getattr(provider, "sequence_parallel", False):
        built = _sequence_parallel(provider, built, vp_stage)
    return built


def _sequence_parallel(provider: Any, spec: Any, vp_stage: int | None) -> Any:
    """SP-capable norms; a layer spec whose block's final norm megatron would build with
    ``WrappedTorchNorm`` becomes this stage's block spec (megatron's own expansion)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import LayerNormImpl, _get_block_submodules
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    if (isinstance(spec, ModuleSpec) and isinstance(spec.module, type)
            and issubclass(spec.module, BaseTransformerLayer)
            and LayerNormImpl is WrappedTorchNorm and not _hybrid(provider)):
        spec = _get_block_submodules(provider, spec, vp_stage, _pp_rank(provider))
    return torch_norms_to_sp(spec) if uses_torch_norms(spec) else spec


def mtp_block_spec(provider: Any, vp_stage: int | None = None, *,
                   backend: str = "auto") -> Any:
    """The multi-token-prediction block spec of ``provider`` (``None`` without MTP layers on
    this stage) over :func:`layer_spec`'s layers, with the backend of those layers: megatron's
    ``get_gpt_mtp_block_spec`` (Bridge's ``mtp_block_spec`` asks for TE's always, which does
    not build without TE)."""
    if not getattr(provider, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    use_te = core_attention_class(backend) is not ReferenceCPAttention
    spec = layer_spec(provider, vp_stage, backend=backend)
    if hasattr(spec, "layer_specs") and len(spec.layer_specs) == 0:
        spec = get_gpt_decoder_layer_specs(provider, use_transformer_engine=use_te,
                                           normalization=provider.normalization,
                                           qk_l2_norm=getattr(provider, "qk_l2_norm", False))[-1]
        spec = _swap_core_attention(spec, core_attention_class(backend),
                                    _per_layer_windows(provider))
    block = get_gpt_mtp_block_spec(provider, spec, use_transformer_engine=use_te,
                                   vp_stage=vp_stage, pp_rank=_pp_rank(provider))
    if block is not None and getattr(provider, "sequence_parallel", False):
        block = torch_norms_to_sp(block)
    return block


def use_cp_attention(provider: Any, *, backend: str = "auto") -> Any:
    """Give ``provider`` megatron-hcp's CP attention, keeping the spec function it has now (a
    family bridge's, e.g. DeepSeek's block spec): its ``transformer_layer_spec`` (hybrid:
    ``hybrid_stack_spec``) becomes :func:`layer_spec` over that spec. Idempotent; returns
    ``provider``."""
    name = _spec_field(provider)
    current = getattr(provider, name, None)
    if not _is_ours(current):
        setattr(provider, name, functools.partial(layer_spec, backend=backend, own=current))
    return provider
