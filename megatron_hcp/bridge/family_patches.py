"""Megatron-Bridge patches that model families need on Bridge's decentralized path.

* ``bridge-gemma3-model-groups``: Bridge's ``Gemma3ModelProvider.provide`` replaces the model's
  embedding (``Gemma3LanguageModelEmbedding``: the sqrt(hidden) scale) and RoPE
  (``Gemma3RotaryEmbedding``: a local and a global base) with modules built without process
  groups, so they fall back to megatron's global groups - which Bridge's decentralized path never
  creates. The embedding's first forward fails (``'NoneType' object has no attribute 'size'``;
  under TP > 1 its table would be split as for one rank) and the RoPE tables are not cut for
  this CP rank (a shape mismatch under CP > 1). The embedding is built with the provider's
  collection's TP group and both RoPE tables take the model's CP group, as megatron's
  ``GPTModel`` builds its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..patching.registry import Patch, Target

__all__ = ["BRIDGE_FAMILY_PATCHES"]

_PKG = "megatron.bridge"
# Bridge releases whose gemma3_provider.py was read and run against
VERSIONS = ("0.6.2",)


def _make_gemma3_embedding(original: type) -> Callable[..., Any]:
    class Gemma3LanguageModelEmbedding(original):  # type: ignore[misc, valid-type]
        """Bridge's Gemma 3 embedding with the provider's TP group (module docstring)."""

        def __init__(self, config: Any, *args: Any, tp_group: Any = None, **kwargs: Any):
            if tp_group is None:
                collection = getattr(config, "_pg_collection", None)
                tp_group = getattr(collection, "tp", None)
            super().__init__(config, *args, tp_group=tp_group, **kwargs)

    Gemma3LanguageModelEmbedding.__module__ = original.__module__
    return Gemma3LanguageModelEmbedding


def _make_gemma3_provide(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        """Bridge's, then Gemma 3's RoPE (global and local tables) on the model's CP group."""
        model = original(self, pre_process=pre_process, post_process=post_process,
                         vp_stage=vp_stage)
        cp_group = getattr(getattr(model, "pg_collection", None), "cp", None)
        rope = getattr(model, "rotary_pos_emb", None)
        for table in (rope, getattr(rope, "rope_local", None)):
            if table is not None and cp_group is not None:
                table.cp_group = cp_group
        return model

    return provide


_GEMMA3 = f"{_PKG}.models.gemma.gemma3_provider"

BRIDGE_FAMILY_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-gemma3-model-groups",
        summary="Gemma 3's embedding and RoPE (rebuilt by Bridge's Gemma3ModelProvider.provide) "
        "take the provider's TP group and the model's CP group, as megatron's GPTModel's do",
        upstream="megatron/bridge/models/gemma/gemma3_provider.py:100-140 provide builds "
        "Gemma3LanguageModelEmbedding(config=self, ...) without tp_group and "
        "Gemma3RotaryEmbedding(...) (its rope_local too, 302-307) without cp_group: "
        "megatron-core 0.19.2's VocabParallelEmbedding and RotaryEmbedding then take the "
        "global groups (tensor_parallel/layers.py:262, rotary_pos_embedding.py:86-90), which "
        "the decentralized path never sets",
        versions=VERSIONS,
        targets=(Target(_GEMMA3, "Gemma3LanguageModelEmbedding", _make_gemma3_embedding),
                 Target(_GEMMA3, "Gemma3ModelProvider.provide", _make_gemma3_provide,
                        params=("self", "pre_process", "post_process", "vp_stage"))),
        category="bridge", package="megatron-bridge",
    ),
)
