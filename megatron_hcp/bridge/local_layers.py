"""A family's Transformer-Engine-only spec as megatron's local layers, where TE is absent.

Some Bridge families write their layer spec with Transformer Engine's modules only (Gemma 3's
``gemma3_layer_spec``: TE's norm-fused linears, ``TENorm`` q/k norms, Bridge's
``TERowParallelLinearLayerNorm`` post-norms). Where TE does not import those names are
placeholders and the model cannot be built. :func:`te_spec_to_local` gives the same layers from
megatron's local modules, module for module and with the same math:

* ``TELayerNormColumnParallelLinear`` (a norm fused into the linear) in ``linear_qkv`` /
  ``linear_fc1`` -> the layer's ``input_layernorm`` / ``pre_mlp_layernorm`` and
  ``ColumnParallelLinear``, as megatron's own local spec splits them;
* ``TEColumnParallelLinear`` / ``TERowParallelLinear`` -> ``ColumnParallelLinear`` /
  ``RowParallelLinear``;
* ``TENorm`` -> :class:`~megatron_hcp.layers.norm.SequenceParallelTorchNorm` (zero-centred gain
  and sequence parallelism as TE's norm takes them);
* ``TERowParallelLinearLayerNorm`` -> :class:`RowParallelLinearPostNorm`;
* the block's final norm -> the same torch norm (megatron's ``WrappedTorchNorm`` refuses a
  zero-centred gain and sequence parallelism).

The core attention slots are left to :mod:`megatron_hcp.bridge.spec`. A TE module of the spec
that has no local equivalent here is refused by name (:class:`~megatron_hcp.bridge.spec.
SpecError`), never dropped. Parameter names follow the local layers (``input_layernorm.weight``
rather than ``linear_qkv.layer_norm_weight``): a checkpoint moves between the two through
Bridge's own weight mappings, not as it is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from typing import Any

from ..layers.norm import SequenceParallelTorchNorm, map_spec
from .spec_error import SpecError

__all__ = ["RowParallelLinearPostNorm", "TE_NAMES", "te_modules", "te_spec_to_local"]

# TE module name -> what it becomes: "norm_column" (norm + column linear), "column", "row",
# "norm", "row_post_norm"
TE_NAMES = {"TELayerNormColumnParallelLinear": "norm_column",
            "TEColumnParallelLinear": "column", "TERowParallelLinear": "row",
            "TENorm": "norm", "TERowParallelLinearLayerNorm": "row_post_norm"}
_TE_HOMES = ("megatron.core.extensions.transformer_engine",
             "megatron.bridge.models.common.te_layers")


def _row_parallel_linear() -> type:
    from megatron.core.tensor_parallel import RowParallelLinear

    return RowParallelLinear


class RowParallelLinearPostNorm:
    """megatron's ``RowParallelLinear`` with a norm on its output (``post_layernorm``): the local
    twin of Bridge's ``TERowParallelLinearLayerNorm`` (Gemma's post-attention / post-MLP norms).
    Built as a subclass of ``RowParallelLinear`` on first use (megatron is imported lazily)."""

    _cls: type | None = None

    def __new__(cls, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        if cls._cls is None:
            cls._cls = _post_norm_class(_row_parallel_linear())
        return cls._cls(input_size, output_size, config=config, **kwargs)


def _post_norm_class(base: type) -> type:
    class _RowParallelLinearPostNorm(base):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = SequenceParallelTorchNorm(config, output_size,
                                                            eps=config.layernorm_epsilon)

        def forward(self, x: Any) -> tuple[Any, Any]:
            output, bias = super().forward(x)
            if bias is not None:
                raise ValueError("RowParallelLinearPostNorm: add_bias_linear=True puts a bias "
                                 "after the post-norm; set add_bias_linear=False (as Bridge's "
                                 "TE layer requires)")
            return self.post_layernorm(output), bias

    _RowParallelLinearPostNorm.__name__ = "RowParallelLinearPostNorm"
    _RowParallelLinearPostNorm.__qualname__ = "RowParallelLinearPostNorm"
    return _RowParallelLinearPostNorm


def te_modules(*module_names: str) -> dict[int, str]:
    """``id(object) -> kind`` (:data:`TE_NAMES`) for every TE name bound in megatron's TE
    extension, Bridge's shared TE layers and ``module_names`` (the modules a spec function was
    written in): what those names hold here, a class or a placeholder."""
    found: dict[int, str] = {}
    for home in (*_TE_HOMES, *module_names):
        module = sys.modules.get(home)
        for name, kind in TE_NAMES.items():
            value = getattr(module, name, None) if module is not None else None
            if value is not None:
                found[id(value)] = kind
    return found


def _local(kind: str) -> Any:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return {"column": ColumnParallelLinear, "row": _row_parallel_linear(),
            "norm": SequenceParallelTorchNorm, "row_post_norm": RowParallelLinearPostNorm}[kind]


def _split_fused_norms(layer: Any, kinds: dict[int, str]) -> Any:
    """A ``TransformerLayerSubmodules`` whose norm-fused QKV / FC1 linears become the layer's
    own input / pre-MLP norm and a column-parallel linear."""
    from megatron.core.transformer.identity_op import IdentityOp

    layer = copy.copy(layer)
    for block_name, slot, norm_name in (("self_attention", "linear_qkv", "input_layernorm"),
                                        ("mlp", "linear_fc1", "pre_mlp_layernorm")):
        block = getattr(layer, block_name, None)
        builder = isinstance(block, functools.partial)  # megatron 0.19's MLP.as_mlp_submodule
        sub = block.keywords.get("submodules") if builder else getattr(block, "submodules", None)
        if sub is None or kinds.get(id(getattr(sub, slot, None))) != "norm_column":
            continue
        if getattr(layer, norm_name) is not IdentityOp:
            raise SpecError(f"{block_name}.submodules.{slot}: a norm-fused linear after "
                            f"{norm_name}={getattr(layer, norm_name)!r} would normalise twice")
        sub = copy.copy(sub)
        setattr(sub, slot, _local("column"))
        if builder:
            block = functools.partial(block.func, *block.args,
                                      **{**block.keywords, "submodules": sub})
        else:
            block = copy.copy(block)
            block.submodules = sub
        setattr(layer, block_name, block)
        setattr(layer, norm_name, SequenceParallelTorchNorm)
    return layer


def _te_names(module_names: tuple[str, ...]) -> dict[int, str]:
    """``id(object) -> name`` of every ``TE*`` name bound in the TE homes and ``module_names``:
    what must not be left in a spec built without TE."""
    found: dict[int, str] = {}
    for home in (*_TE_HOMES, *module_names):
        module = sys.modules.get(home)
        for name in dir(module) if module is not None else ():
            value = getattr(module, name)
            if name.startswith("TE") and value is not None and callable(value):
                found[id(value)] = name
    return found


def _translate(node: Any, kinds: dict[int, str], te_names: dict[int, str]) -> Any:
    """``node`` (a block spec, or one layer's ``ModuleSpec``) with its transformer layers' fused
    norms split and every TE module replaced by its twin; a TE module left (outside the core
    attention, which :mod:`.spec` swaps) raises ``SpecError`` naming it."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        BaseTransformerLayer,
        TransformerLayerSubmodules,
    )

    def layer(spec: Any) -> Any:
        if (isinstance(spec, ModuleSpec) and isinstance(spec.module, type)
                and issubclass(spec.module, BaseTransformerLayer)
                and isinstance(spec.submodules, TransformerLayerSubmodules)):
            spec = copy.copy(spec)
            spec.submodules = _split_fused_norms(spec.submodules, kinds)
        return spec

    if isinstance(node, ModuleSpec):
        node = layer(node)
    else:
        node = copy.copy(node)
        node.layer_specs = [layer(spec) for spec in node.layer_specs]

    def replace(path: tuple[str, ...], value: Any) -> Any:
        kind = kinds.get(id(value))
        if kind == "norm_column":
            raise SpecError(f"{'.'.join(path)}: Transformer Engine's norm-fused linear outside "
                            "a layer's QKV / FC1 has no local equivalent here; this spec "
                            "builds only where Transformer Engine imports")
        if kind is not None:
            return _local(kind)
        if id(value) in te_names and (not path or path[-1] != "core_attention"):
            raise SpecError(f"{'.'.join(path)}={te_names[id(value)]}: a Transformer Engine "
                            "module with no local equivalent here; this spec builds only where "
                            "Transformer Engine imports")
        return value

    return map_spec(node, replace)


def te_spec_to_local(spec: Any, config: Any, *, vp_stage: int | None, pp_rank: int | None,
                     module_names: tuple[str, ...] = ()) -> Any:
    """``spec`` with every Transformer Engine module replaced by its megatron local equivalent
    (module docstring). A layer ``ModuleSpec`` or a block spec becomes this pipeline stage's
    block spec, a TE module without a twin raising ``SpecError``. A hybrid stack spec
    (megatron's ``HybridStack``: Nemotron-H) keeps its kinds of layer: those whose TE modules all
    have twins (attention, MLP) are translated, the others (Mamba, whose mixer needs mamba_ssm's
    kernels; GDN, MLA, DSA, MoE) are left as they are and build only where TE imports.
    ``module_names``: the modules the spec function was written in (where its TE names were
    imported)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import _get_block_submodules

    kinds, te_names = te_modules(*module_names), _te_names(module_names)
    if isinstance(spec, ModuleSpec) and _is_hybrid_stack(spec.module):
        spec = copy.copy(spec)
        spec.submodules = copy.copy(spec.submodules)
        for field in dataclasses.fields(spec.submodules):
            layer = getattr(spec.submodules, field.name)
            if not isinstance(layer, ModuleSpec):
                continue
            try:
                setattr(spec.submodules, field.name, _translate(layer, kinds, te_names))
            except SpecError:
                continue  # this kind of layer keeps its TE modules (docstring)
        return spec
    block = copy.copy(_get_block_submodules(config, spec, vp_stage, pp_rank))
    if block.layer_norm is WrappedTorchNorm:  # megatron's LayerNormImpl without apex
        block.layer_norm = SequenceParallelTorchNorm
    return _translate(block, kinds, te_names)


def _is_hybrid_stack(module: Any) -> bool:
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack
    except ImportError:  # megatron-core before the hybrid model (0.16: MambaStack)
        return False
    return isinstance(module, type) and issubclass(module, HybridStack)
