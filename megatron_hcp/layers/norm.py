"""A torch norm that megatron's sequence parallelism accepts on the local (non-TE) spec.

megatron's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel=True`` (TE's and apex's norms accept it). Under sequence parallelism a norm
sees only this TP rank's slice of the sequence, so its weight gradient is partial: megatron sums
it over the TP group in ``finalize_model_grads`` for every parameter marked
``param.sequence_parallel = True`` - the mark TE's norms set. :class:`SequenceParallelTorchNorm`
is torch's LayerNorm / RMSNorm with that mark; :func:`with_sequence_parallel_norms` puts it into
a layer spec and a block spec (final norm included).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["SequenceParallelTorchNorm", "uses_torch_norms", "with_sequence_parallel_norms"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` / ``RMSNorm`` (``config.normalization``) whose parameters
    carry ``sequence_parallel = config.sequence_parallel`` (megatron's norm signature)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                     "memory_efficient_layer_norm"):
            if getattr(config, name, False):
                raise ValueError(f"{name}=True is not supported by the torch norm of the local "
                                 f"spec; set {name}=False")
        norm_cls = _NORMS.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization={config.normalization!r}: the local spec's torch "
                             f"norm supports {', '.join(_NORMS)}")
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def uses_torch_norms(layer_spec: Any) -> bool:
    """True when ``layer_spec`` builds its norms with megatron's ``WrappedTorchNorm`` (the local
    spec without apex), the norm that refuses SP. TE's spec (norms fused into TE's linear
    layers, TENorm) and apex's FusedLayerNorm accept SP as they are."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return any(getattr(layer_spec.submodules, name, None) is WrappedTorchNorm
               for name in ("input_layernorm", "pre_mlp_layernorm"))


def with_sequence_parallel_norms(layer_spec: Any, config: Any, vp_stage: int | None,
                                 pp_rank: int) -> Any:
    """A block spec of this pipeline stage's layers (``layer_spec`` each) whose norms - the
    layers' input / pre-MLP norms and the block's final norm - are
    :class:`SequenceParallelTorchNorm`."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = copy.deepcopy(layer_spec)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer.submodules, name, None) is not None:
            setattr(layer.submodules, name, SequenceParallelTorchNorm)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count,
                                      layer_norm=SequenceParallelTorchNorm)
