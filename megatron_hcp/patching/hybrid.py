"""The hybrid (Mamba / attention / MLP) stack's final norm without Transformer Engine.

* ``hybrid-final-norm-without-te``: megatron-core builds the final norm of its hybrid stack
  (``HybridStack``, the decoder of Nemotron-H through Bridge's ``HybridModelProvider``; 0.16's
  ``MambaStack``) with TE's ``TENorm`` always, whatever the layer spec. Where Transformer Engine
  is absent that cannot be built, so no hybrid model builds on a CPU even when its layers have
  local twins (:mod:`megatron_hcp.bridge.local_layers`). Without TE the final norm is
  megatron-hcp's torch norm (``SequenceParallelTorchNorm``: LayerNorm / RMSNorm as the config
  says, zero-centred gain, sequence parallelism as TE's norm takes them); with TE, ``TENorm``.
"""

from __future__ import annotations

from typing import Any

from .registry import Patch, Target

__all__ = ["HYBRID_PATCHES"]


def _final_norm(original: Any) -> Any:
    """``TENorm`` where TE imports, else the torch norm that takes the same arguments."""
    from megatron.core.extensions import transformer_engine as te_ext

    if getattr(te_ext, "HAVE_TE", False):
        return original
    from ..layers.norm import SequenceParallelTorchNorm

    return SequenceParallelTorchNorm


HYBRID_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="hybrid-final-norm-without-te",
        summary="the hybrid stack's final norm is a torch norm where Transformer Engine is "
        "absent (TENorm where it imports)",
        upstream="megatron/core/models/hybrid/hybrid_block.py:19,215 (0.19.2) and "
        "megatron/core/ssm/mamba_block.py:18,166 (0.16.1): self.final_norm = TENorm(config=..., "
        "hidden_size=..., eps=...) whatever the layer spec; without TE megatron's TE extension "
        "has no working TENorm",
        versions=("0.16.1", "0.19.2"),
        targets=(
            Target("megatron.core.models.hybrid.hybrid_block", "TENorm", _final_norm,
                   versions=("0.19.2",)),
            Target("megatron.core.ssm.mamba_block", "TENorm", _final_norm,
                   versions=("0.16.1",)),
        ),
        category="cpu-runtime",
    ),
)
