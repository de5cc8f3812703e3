"""The layer spec a Megatron-Bridge GPT provider builds with megatron-hcp's CP attention.

``provider.transformer_layer_spec = megatron_hcp.bridge.layer_spec`` (Bridge calls it with the
provider and, under virtual pipelining, the ``vp_stage``): megatron's Transformer Engine spec
where TE imports (its ``TEDotProductAttention`` with the ``te-attention-hcp`` patch), else
megatron's local spec with :class:`~megatron_hcp.attention.module.ReferenceCPAttention` - and,
under sequence parallelism, norms that accept it
(:mod:`megatron_hcp.layers.norm`).
"""

from __future__ import annotations

from typing import Any

from ..attention.module import gpt_layer_spec
from ..layers.norm import uses_torch_norms, with_sequence_parallel_norms

__all__ = ["layer_spec"]


def layer_spec(provider: Any, vp_stage: int | None = None, *, backend: str = "auto") -> Any:
    """The layer (or, with sequence parallelism on the local spec, block) spec of ``provider``'s
    pipeline stage ``vp_stage``; ``backend`` as in :func:`~..attention.module.gpt_layer_spec`."""
    kwargs = {"multi_latent_attention": True} if getattr(
        provider, "multi_latent_attention", False) else {}
    spec = gpt_layer_spec(backend, **kwargs)
    if getattr(provider, "sequence_parallel", False) and uses_torch_norms(spec):
        pgc = getattr(provider, "_pg_collection", None)
        pp_rank = pgc.pp.rank() if pgc is not None else 0
        spec = with_sequence_parallel_norms(spec, provider, vp_stage, pp_rank)
    return spec
