"""A torch norm that megatron's sequence parallelism accepts on the local (non-TE) spec.

megatron's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel=True`` (TE's and apex's norms accept it). Under sequence parallelism a norm
sees only this TP rank's slice of the sequence, so its weight gradient is partial: megatron sums
it over the TP group in ``finalize_model_grads`` for every parameter marked
``param.sequence_parallel = True`` - the mark TE's norms set. :class:`SequenceParallelTorchNorm`
is torch's LayerNorm / RMSNorm with that mark (as TE's ``TENorm``); :func:`torch_norms_to_sp`
puts it in place of every ``WrappedTorchNorm`` of a spec tree - the layers' input / pre-MLP
norms, the q/k (MLA: q/kv) layernorms, the block's final norm, MTP's norms - and
:func:`with_sequence_parallel_norms` builds a stage's block spec from a layer spec with it.

q/k norms: megatron sums their weight gradients over TP by name whenever ``qk_layernorm`` is on
(each rank holds other heads), so the mark changes nothing there; MLA's ``kv_layernorm`` sees
this rank's slice of the sequence under SP and needs it - the same marks TE's norms carry.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SequenceParallelTorchNorm", "ZeroCenteredGammaNorm", "map_spec",
           "torch_norms_to_sp", "uses_torch_norms", "with_sequence_parallel_norms"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class ZeroCenteredGammaNorm(torch.nn.Module):
    """LayerNorm / RMSNorm whose weight is stored centred on zero and applied as ``1 + weight``
    (megatron's ``layernorm_zero_centered_gamma``, TE's ``zero_centered_gamma``: Gemma's norms).
    The weight starts at zero (a norm of gain one), the bias (LayerNorm) at zero."""

    def __init__(self, normalization: str, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.normalization, self.eps = normalization, eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size))
                     if normalization == "LayerNorm" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.weight + 1
        shape = (self.weight.shape[0],)
        if self.normalization == "LayerNorm":
            return torch.nn.functional.layer_norm(x, shape, gain, self.bias, self.eps)
        return torch.nn.functional.rms_norm(x, shape, gain, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalization}, {self.weight.shape[0]}, eps={self.eps}, gain=1+weight"


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` / ``RMSNorm`` (``config.normalization``), or
    :class:`ZeroCenteredGammaNorm` under ``layernorm_zero_centered_gamma``, whose parameters
    carry ``sequence_parallel = config.sequence_parallel`` (megatron's norm signature)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        for name in ("persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, name, False):
                raise ValueError(f"{name}=True is not supported by the torch norm of the local "
                                 f"spec; set {name}=False")
        norm_cls = _NORMS.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization={config.normalization!r}: the local spec's torch "
                             f"norm supports {', '.join(_NORMS)}")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            norm = ZeroCenteredGammaNorm(config.normalization, hidden_size, eps)
        else:
            norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def map_spec(node: Any, replace: Callable[[tuple[str, ...], Any], Any],
             path: tuple[str, ...] = ()) -> Any:
    """A copy of megatron spec tree ``node`` (``ModuleSpec``, submodule dataclasses,
    ``TransformerBlockSubmodules``, ``functools.partial`` builders, lists, dicts) whose every
    other value ``v`` at field path ``path`` is ``replace(path, v)`` (return ``v`` to keep it).
    Classes, functions and placeholders are leaves, never walked into."""
    if isinstance(node, functools.partial):
        func = map_spec(node.func, replace, (*path, "<func>"))
        args = [map_spec(a, replace, (*path, str(i))) for i, a in enumerate(node.args)]
        keywords = {k: map_spec(v, replace, (*path, k)) for k, v in node.keywords.items()}
        return functools.partial(func, *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = copy.copy(node)
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            new = map_spec(value, replace, (*path, field.name))
            if new is not value:
                object.__setattr__(out, field.name, new)
        return out
    if isinstance(node, (list, tuple)):
        items = [map_spec(v, replace, (*path, str(i))) for i, v in enumerate(node)]
        return type(node)(items) if isinstance(node, tuple) else items
    if isinstance(node, dict):
        return {k: map_spec(v, replace, (*path, str(k))) for k, v in node.items()}
    return replace(path, node)


def _spec_leaves(node: Any) -> list[Any]:
    found: list[Any] = []

    def keep(path: tuple[str, ...], value: Any) -> Any:
        found.append(value)
        return value

    map_spec(node, keep)
    return found


def torch_norms_to_sp(spec: Any) -> Any:
    """``spec`` with :class:`SequenceParallelTorchNorm` in place of every megatron
    ``WrappedTorchNorm`` (the norm the local spec uses without apex, which refuses SP)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return map_spec(spec, lambda path, value: (
        SequenceParallelTorchNorm if value is WrappedTorchNorm else value))


def uses_torch_norms(layer_spec: Any) -> bool:
    """True when ``layer_spec`` builds any norm with megatron's ``WrappedTorchNorm`` (the local
    spec without apex), the norm that refuses SP. TE's spec (norms fused into TE's linear
    layers, TENorm) and apex's FusedLayerNorm accept SP as they are."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return any(leaf is WrappedTorchNorm for leaf in _spec_leaves(layer_spec))


def with_sequence_parallel_norms(layer_spec: Any, config: Any, vp_stage: int | None,
                                 pp_rank: int) -> Any:
    """A block spec of this pipeline stage's layers (``layer_spec`` each) whose torch norms - the
    layers' input / pre-MLP norms, q/k layernorms, and the block's final norm - are
    :class:`SequenceParallelTorchNorm`."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = torch_norms_to_sp(layer_spec)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count,
                                      layer_norm=SequenceParallelTorchNorm)
