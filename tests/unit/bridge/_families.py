"""Tiny Hugging Face configs of real model families, and Bridge's recipes of them made CPU runs.

The product's :mod:`megatron_hcp.bridge.family_recipes` under the names the tests use:

* :func:`write_tiny_config`: a ``transformers`` config of Qwen3-MoE, Qwen3, Llama 3, gpt-oss,
  DeepSeek-V3 or Gemma 3 shrunk to a few layers, saved with ``save_pretrained`` (a user's local
  config directory); :data:`RECIPES` names Bridge's recipe function of each family, which
  :func:`megatron_hcp.bridge.offline.recipe_from_hf_config` runs from that directory.
* :func:`tiny_direct_recipe`: a family whose recipe builds its provider itself (Gemma 3's) run
  as it is, its model shrunk.
* :func:`cpu_fp32`: a recipe's ``ConfigContainer`` made a CPU run that CP layouts compare to
  the last bit (fp32, no fused or Transformer Engine kernels, no recompute; mock data; the
  optimizer, scheduler and DDP of the project's tiny recipes), the provider's own spec kept
  with the reference CP attention (``megatron_hcp.bridge.spec.use_cp_attention``: MoE layers,
  q/k norms, SP norms).
"""

from __future__ import annotations

from megatron_hcp.bridge.family_recipes import (
    DIRECT_RECIPES,
    FAMILY_RECIPES,
    cpu_fp32,
    tiny_direct_recipe,
    write_tiny_config,
)

__all__ = ["DIRECT_RECIPES", "RECIPES", "cpu_fp32", "tiny_direct_recipe", "write_tiny_config"]

RECIPES = FAMILY_RECIPES  # family -> Bridge's pre-training recipe function of it
