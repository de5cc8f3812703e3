"""Megatron-Bridge's own recipes of real model families, tiny, offline, as CPU fp32 runs.

Bridge's model recipe functions (``megatron.bridge.recipes.*``) build their providers from a
Hugging Face model on the Hub; the functions here run them as they are with a tiny local config
instead (:func:`megatron_hcp.bridge.offline.recipe_from_hf_config`), so the model is the family's
own (Bridge's family bridge, its spec function, its MoE / MLA / window / sink choices) at a size
a CPU trains in seconds:

* :data:`FAMILY_RECIPES`: the family -> Bridge's pre-training recipe function of it;
  :func:`tiny_hf_config` / :func:`write_tiny_config`: its tiny ``transformers`` config (2 layers,
  hidden 64, 4 heads / 2 KV heads, vocabulary 256; the family's features kept, e.g. Qwen3-MoE's 8
  experts of 32 with top-2, DeepSeek-V3's MLA, YaRN, shared expert and MTP layer, gpt-oss's sinks
  and a 32-token window every 2nd layer), as ``save_pretrained`` writes a user's config directory;
* :data:`DIRECT_RECIPES` / :func:`tiny_direct_recipe`: families whose Bridge recipe builds its
  provider itself (Gemma 3, Nemotron-H's attention and MLP layers), called as they are and the
  model shrunk;
* :func:`cpu_fp32`: a recipe's ``ConfigContainer`` made a CPU run that CP layouts compare to the
  last bit (fp32, no fused or Transformer Engine kernels, no recompute, Bridge's mock GPT data,
  the optimizer, scheduler and DDP of the project's tiny recipes), the provider's own spec kept
  with the reference CP attention (:func:`megatron_hcp.bridge.spec.use_cp_attention`);
* :func:`tiny_family_pretrain_config`: all of it in one recipe function, for the functional
  harness (``BRIDGE.recipe: tiny_family_pretrain_config``, ``recipe_args: {family: qwen3_moe}``)
  and any caller of Bridge's ``pretrain``.

Nothing here downloads: the Hub is offline while a recipe runs (``recipe_from_hf_config``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["DIRECT_RECIPES", "FAMILY_RECIPES", "cpu_fp32", "tiny_direct_recipe",
           "tiny_family_pretrain_config", "tiny_hf_config", "write_tiny_config"]

_QWEN = "megatron.bridge.recipes.qwen.h100"
FAMILY_RECIPES = {  # family -> Bridge's pre-training recipe function of it (from a HF config)
    "qwen3_moe": f"{_QWEN}.qwen3_moe:qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config",
    "qwen3": f"{_QWEN}.qwen3:qwen3_600m_pretrain_1gpu_h100_bf16_config",
    "llama3": "megatron.bridge.recipes.llama.h100.llama3:llama3_8b_pretrain_2gpu_h100_bf16_config",
    "gpt_oss": "megatron.bridge.recipes.gpt_oss.h100.gpt_oss:"
               "gpt_oss_20b_pretrain_16gpu_h100_bf16_config",
    "deepseek_v3": "megatron.bridge.recipes.deepseek.h100.deepseek_v3:"
                   "deepseek_v3_pretrain_256gpu_h100_bf16_32nodes_config",
}
# families whose Bridge recipe builds its provider itself (no Hugging Face config to read):
# the recipe function, and the sizes that shrink its model
DIRECT_RECIPES = {
    "gemma3": ("megatron.bridge.recipes.gemma.h100.gemma3:gemma3_1b_pretrain_1gpu_h100_bf16_config",
               {"num_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
                "num_query_groups": 2, "kv_channels": 16, "ffn_hidden_size": 128,
                "window_size": 32, "vocab_size": 256}),
    # Nemotron-H's attention and MLP layers (Bridge's HybridModelProvider, megatron's hybrid
    # stack): its Mamba layers need mamba_ssm's kernels, which do not run on a CPU
    "nemotron_h": ("megatron.bridge.recipes.nemotronh.h100.nemotronh:"
                   "nemotronh_4b_pretrain_1gpu_h100_bf16_config",
                   {"hybrid_layer_pattern": "*-*-", "num_layers": 4, "hidden_size": 64,
                    "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
                    "ffn_hidden_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 16,
                    "mamba_state_dim": 16, "mamba_num_groups": 1, "vocab_size": 256}),
}

_COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "tie_word_embeddings": False}


def _families() -> str:
    return ", ".join([*FAMILY_RECIPES, *DIRECT_RECIPES])


def tiny_hf_config(family: str, **fields: Any) -> Any:
    """The tiny ``transformers`` config of ``family`` (a key of :data:`FAMILY_RECIPES`, or
    ``gemma3``), ``fields`` on top: 2 layers, hidden 64, 4 heads / 2 KV heads, vocabulary 256,
    256 positions, untied embeddings, and the family's features at that size."""
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if family == "qwen3_moe":  # 8 experts of 32, top-2, q/k norms
        return Qwen3MoeConfig(**{**_COMMON, "head_dim": 16, "moe_intermediate_size": 32,
                                 "num_experts": 8, "num_experts_per_tok": 2,
                                 "architectures": ["Qwen3MoeForCausalLM"], **fields})
    if family == "qwen3":
        return Qwen3Config(**{**_COMMON, "head_dim": 16,
                              "architectures": ["Qwen3ForCausalLM"], **fields})
    if family == "llama3":
        return LlamaConfig(**{**_COMMON, "architectures": ["LlamaForCausalLM"], **fields})
    if family == "gpt_oss":  # sinks, a 32-token window every 2nd layer, 8 experts of 32, top-2
        return GptOssConfig(**{**_COMMON, "head_dim": 16, "intermediate_size": 32,
                               "num_local_experts": 8,
                               "num_experts_per_tok": 2, "sliding_window": 32,
                               "architectures": ["GptOssForCausalLM"], **fields})
    if family == "deepseek_v3":  # MLA, YaRN, a dense layer then MoE with a shared expert, MTP
        return DeepseekV3Config(**{
            **_COMMON, "num_key_value_heads": 4, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "num_nextn_predict_layers": 1,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "architectures": ["DeepseekV3ForCausalLM"], **fields})
    if family == "gemma3":  # 6 layers: 5 with a 32-token window, then a global one
        return Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 6, "head_dim": 16,
                                   "sliding_window": 32, "architectures": ["Gemma3ForCausalLM"],
                                   **fields})
    raise ValueError(f"family={family!r}: one of {', '.join(FAMILY_RECIPES)}, gemma3")


def write_tiny_config(family: str, directory: str | os.PathLike, **fields: Any) -> Path:
    """:func:`tiny_hf_config` of ``family`` (``fields`` on top) saved to ``directory`` as
    ``save_pretrained`` writes it; returns the directory.

    Safe when several ranks write the same directory at once: each saves into a temporary
    directory next to it and moves every file into place with an atomic rename, so a reader
    sees a whole ``config.json`` (whichever rank's: they are the same)."""
    directory = Path(directory)
    config = tiny_hf_config(family, **fields)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        config.save_pretrained(str(tmp))
        for item in sorted(tmp.iterdir()):
            os.replace(item, directory / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def tiny_direct_recipe(family: str, **fields: Any) -> Any:
    """Bridge's own recipe of ``family`` (:data:`DIRECT_RECIPES`) called as it is, its model
    shrunk to the tiny sizes (``fields`` on top): Gemma 3's 1B recipe with 6 layers - 5 with a
    32-token window, then a global one - hidden 64, 4 heads / 2 KV heads of 16, vocabulary 256,
    the recipe's zero-centred norms, q/k norms, post-norms, softmax scale and two RoPE bases."""
    import importlib

    path, sizes = DIRECT_RECIPES[family]
    module, _, name = path.rpartition(":")
    cfg = getattr(importlib.import_module(module), name)()
    for field, value in {**sizes, **fields}.items():
        setattr(cfg.model, field, value)
    return cfg


def cpu_fp32(cfg: Any, *, seq_length: int = 64, train_iters: int = 5,
             global_batch_size: int = 8, seed: int = 1234) -> Any:
    """``cfg`` (a Bridge recipe's ``ConfigContainer``) as a CPU fp32 run on mock data: the
    model keeps its architecture (the recipe's provider and its spec, with megatron-hcp's
    reference CP attention), everything a GPU run adds is turned off (bf16, fused and
    Transformer Engine kernels, recompute, CUDA graphs, the recipe's model parallelism - set
    what a run needs with overrides), MoE layers use the alltoall dispatcher with an fp32
    router; Bridge's mock GPT dataset over the model's vocabulary (``NullTokenizer``), and the
    optimizer, scheduler, DDP and logging of the project's tiny recipes."""
    import torch
    from megatron.bridge.training.config import MockGPTDatasetConfig

    from .spec import use_cp_attention
    from .training_common import common_training

    model = cfg.model
    for name, value in {
        "bf16": False, "fp16": False, "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32, "transformer_impl": "local",
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "bias_dropout_fusion": False,
        "bias_activation_fusion": False, "masked_softmax_fusion": False,
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
        "persist_layer_norm": False, "cross_entropy_loss_fusion": False,
        "calculate_per_token_loss": True, "recompute_granularity": None,
        "recompute_method": None, "recompute_num_layers": None, "seq_length": seq_length,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "sequence_parallel": False, "cuda_graph_impl": "none", "init_method_std": 0.02,
        "moe_permute_fusion": False,  # a TE kernel some recipes set even for dense models
        "pipeline_model_parallel_layout": None,  # the recipe's, for its many pipeline stages
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
    }.items():
        setattr(model, name, value)
    use_cp_attention(model, backend="reference")
    if getattr(model, "num_moe_experts", None):
        for name, value in {
            "moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_router_fusion": False,
            "moe_token_dispatcher_type": "alltoall", "moe_flex_dispatcher_backend": None,
            "moe_shared_expert_overlap": False, "moe_router_dtype": "fp32",
        }.items():
            setattr(model, name, value)
    cfg.dataset = MockGPTDatasetConfig(
        random_seed=seed, reset_attention_mask=False, reset_position_ids=False,
        eod_mask_loss=False, seq_length=seq_length, num_dataset_builder_threads=1,
        dataloader_type="single", num_workers=0, data_sharding=True)
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model = "NullTokenizer", None
    cfg.tokenizer.vocab_size, cfg.tokenizer.use_tokenizer_vocab_size = model.vocab_size, False
    cfg.env_vars = {}
    return common_training(cfg, train_iters=train_iters, global_batch_size=global_batch_size,
                           micro_batch_size=1, lr=1e-3, seed=seed)


def tiny_family_pretrain_config(family: str, *, data_dir: str | None = None,
                                seq_length: int = 64, train_iters: int = 5,
                                global_batch_size: int = 8, seed: int = 1234) -> Any:
    """Pre-training of the tiny ``family`` by Bridge's own recipe of it, as a CPU fp32 run on
    Bridge's mock GPT data (:func:`cpu_fp32`): a family of :data:`FAMILY_RECIPES` runs its
    recipe offline (:func:`~megatron_hcp.bridge.offline.recipe_from_hf_config`) from the tiny
    config :func:`write_tiny_config` saves under ``data_dir`` (``<data_dir>/<family>-config``,
    as a user's local model directory; every rank may write it at once), or from the config in
    memory without ``data_dir``; a family of :data:`DIRECT_RECIPES` calls its recipe as it is,
    shrunk (:func:`tiny_direct_recipe`). Parallelism comes from overrides
    (``model.context_parallel_size=4``, ``model.expert_model_parallel_size=2``, ...)."""
    from .offline import recipe_from_hf_config

    if family in DIRECT_RECIPES:
        cfg = tiny_direct_recipe(family)
    elif family in FAMILY_RECIPES:
        source = (tiny_hf_config(family) if data_dir is None
                  else str(write_tiny_config(family, Path(data_dir) / f"{family}-config")))
        cfg = recipe_from_hf_config(FAMILY_RECIPES[family], source)
    else:
        raise ValueError(f"family={family!r}: one of {_families()}")
    return cpu_fp32(cfg, seq_length=seq_length, train_iters=train_iters,
                    global_batch_size=global_batch_size, seed=seed)
