"""Megatron-Bridge recipe functions for a tiny Llama-style model (the functional recipes' models).

Written like Bridge's own recipes (``megatron.bridge.recipes.*``): start from Bridge's recipe
base (``_pretrain_common`` / ``_sft_common``) and set the model, data and training fields; the
result is Bridge's ``ConfigContainer``, trained by Bridge's ``pretrain`` / ``finetune``
unchanged. The model is Bridge's ``GPTModelProvider`` with Llama's choices (RMSNorm, SwiGLU,
RoPE, GQA, no biases, untied embeddings) at a size a CPU trains in seconds, its layer spec
:func:`megatron_hcp.bridge.spec.layer_spec` (Transformer Engine where it imports, else
megatron's local spec with the reference CP attention). Bridge's model recipes build their
providers from Hugging Face configs, which needs a download; these need none.

* :func:`tiny_llama_pretrain_config`: Bridge's mock GPT dataset (fixed-length rows).
* :func:`tiny_llama_sft_config`: Bridge's packed SFT dataset (``GPTSFTPackedParquetDataset``)
  over variable-length sequences, written by :func:`write_packed_sft_data` with Bridge's own
  Parquet writer, and a word-level Hugging Face tokenizer (:func:`write_tokenizer`).
* :func:`tiny_deepseek_v3_pretrain_config`: the DeepSeek-V3 architecture (MLA, YaRN RoPE, a dense
  and a MoE layer with a shared expert, multi-token prediction) as Bridge's own DeepSeek-V3
  bridge makes its provider from a Hugging Face config - built in memory, no download - on
  Bridge's mock GPT dataset.
* :func:`tiny_family_pretrain_config` (defined in :mod:`megatron_hcp.bridge.family_recipes`):
  Bridge's own recipe of a real family (Qwen3-MoE, DeepSeek-V3, gpt-oss, Gemma 3, ...) run
  offline from a tiny Hugging Face config, made a CPU fp32 run on mock data.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .family_recipes import tiny_family_pretrain_config
from .training_common import common_training

__all__ = ["tiny_deepseek_v3_pretrain_config", "tiny_family_pretrain_config",
           "tiny_llama_pretrain_config", "tiny_llama_sft_config", "write_packed_sft_data",
           "write_tokenizer"]


def _tiny_llama(seq_length: int, vocab_size: int, num_layers: int, hidden_size: int,
                num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int) -> Any:
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    from .spec import layer_spec

    return GPTModelProvider(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
        normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        seq_length=seq_length, vocab_size=vocab_size, make_vocab_size_divisible_by=128,
        transformer_layer_spec=layer_spec,
        # fp32 and no fused kernels: runs anywhere, and CP layouts compare to the last bit
        bf16=False, fp16=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, calculate_per_token_loss=True)


def tiny_llama_pretrain_config(*, seq_length: int = 64, vocab_size: int = 256,
                               num_layers: int = 4, hidden_size: int = 64,
                               num_attention_heads: int = 4, num_query_groups: int = 2,
                               ffn_hidden_size: int = 128, train_iters: int = 6,
                               global_batch_size: int = 8, micro_batch_size: int = 1,
                               lr: float = 1e-3, seed: int = 1234) -> Any:
    """Pre-training of the tiny Llama on Bridge's mock GPT dataset (Bridge's pretrain base)."""
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.config import MockGPTDatasetConfig

    cfg = _pretrain_common()
    cfg.model = _tiny_llama(seq_length, vocab_size, num_layers, hidden_size,
                            num_attention_heads, num_query_groups, ffn_hidden_size)
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = vocab_size
    cfg.tokenizer.use_tokenizer_vocab_size = False
    cfg.dataset = MockGPTDatasetConfig(
        random_seed=seed, reset_attention_mask=False, reset_position_ids=False,
        eod_mask_loss=False, seq_length=seq_length, num_dataset_builder_threads=1,
        dataloader_type="single", num_workers=0, data_sharding=True)
    return common_training(cfg, train_iters=train_iters, global_batch_size=global_batch_size,
                           micro_batch_size=micro_batch_size, lr=lr, seed=seed)


def _tiny_deepseek_v3(seq_length: int, vocab_size: int, num_layers: int, hidden_size: int,
                      num_attention_heads: int, num_experts: int, mtp_num_layers: int) -> Any:
    """Bridge's DeepSeek-V3 provider (``DeepSeekV3Bridge.provider_bridge``) of a tiny Hugging
    Face ``DeepseekV3Config``: the first layer dense, the others MoE (``first_k_dense_replace=1``
    -> ``moe_layer_freq``), top-2 routing over ``num_experts`` experts plus one shared expert,
    MLA with low-rank q and kv, YaRN RoPE (factor 4 over 32 original positions), sigmoid scores
    with expert bias and the sequence auxiliary loss, ``mtp_num_layers`` MTP layers. Its own
    spec function (megatron's block spec) is kept with megatron-hcp's CP attention
    (:func:`~megatron_hcp.bridge.spec.use_cp_attention`); Bridge's GPU choices become a CPU fp32
    run's (no fused kernels, no grouped GEMM, the allgather dispatcher, fp32 router)."""
    from types import SimpleNamespace

    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge
    from transformers import DeepseekV3Config

    from .spec import use_cp_attention

    hf_config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads,
        n_routed_experts=num_experts, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_nextn_predict_layers=mtp_num_layers, max_position_embeddings=4 * seq_length,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, architectures=["DeepseekV3ForCausalLM"])
    provider = DeepSeekV3Bridge().provider_bridge(SimpleNamespace(config=hf_config))
    for name, value in {
        "seq_length": seq_length, "make_vocab_size_divisible_by": 128,
        # fp32 and no fused kernels: runs anywhere, and CP layouts compare to the last bit
        "bf16": False, "fp16": False, "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32, "autocast_dtype": torch.float32,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "bias_dropout_fusion": False,
        "bias_activation_fusion": False, "masked_softmax_fusion": False,
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
        "persist_layer_norm": False, "cross_entropy_loss_fusion": False,
        "calculate_per_token_loss": True, "moe_grouped_gemm": False,
        "moe_permute_fusion": False, "moe_router_fusion": False,
        "moe_shared_expert_overlap": False, "moe_token_dispatcher_type": "allgather",
    }.items():
        setattr(provider, name, value)
    return use_cp_attention(provider)


def tiny_deepseek_v3_pretrain_config(*, seq_length: int = 64, vocab_size: int = 256,
                                     num_layers: int = 2, hidden_size: int = 64,
                                     num_attention_heads: int = 4, num_experts: int = 4,
                                     mtp_num_layers: int = 1, train_iters: int = 6,
                                     global_batch_size: int = 8, micro_batch_size: int = 1,
                                     lr: float = 1e-3, seed: int = 1234) -> Any:
    """Pre-training of a tiny DeepSeek-V3 (:func:`_tiny_deepseek_v3`; ``mtp_num_layers=0``: no
    MTP) on Bridge's mock GPT dataset (Bridge's pretrain base)."""
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.config import MockGPTDatasetConfig

    cfg = _pretrain_common()
    cfg.model = _tiny_deepseek_v3(seq_length, vocab_size, num_layers, hidden_size,
                                  num_attention_heads, num_experts, mtp_num_layers)
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = vocab_size
    cfg.tokenizer.use_tokenizer_vocab_size = False
    cfg.dataset = MockGPTDatasetConfig(
        random_seed=seed, reset_attention_mask=False, reset_position_ids=False,
        eod_mask_loss=False, seq_length=seq_length, num_dataset_builder_threads=1,
        dataloader_type="single", num_workers=0, data_sharding=True)
    return common_training(cfg, train_iters=train_iters, global_batch_size=global_batch_size,
                           micro_batch_size=micro_batch_size, lr=lr, seed=seed)


def tiny_llama_sft_config(data_dir: str, *, seq_length: int = 128, vocab_size: int = 256,
                          num_layers: int = 4, hidden_size: int = 64,
                          num_attention_heads: int = 4, num_query_groups: int = 2,
                          ffn_hidden_size: int = 128, train_iters: int = 6,
                          global_batch_size: int = 8, lr: float = 1e-3, seed: int = 1234,
                          rows: int = 64, median_length: float = 24.0, sigma: float = 0.9,
                          min_length: int = 4, max_length: int | None = None) -> Any:
    """Fine-tuning of the tiny Llama on packed variable-length sequences (Bridge's SFT base):
    ``rows`` packed rows of at most ``seq_length`` tokens, sequence lengths lognormal (median
    ``median_length``, shape ``sigma``) in ``[min_length, max_length]``, written once into
    ``data_dir`` with the tokenizer."""
    from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig
    from megatron.bridge.data.packing.config import PackedSequenceSpecs
    from megatron.bridge.recipes.common import _sft_common

    root = Path(data_dir)
    train, valid = write_packed_sft_data(
        root, seq_length=seq_length, vocab_size=vocab_size, rows=rows, seed=seed,
        median_length=median_length, sigma=sigma, min_length=min_length,
        max_length=max_length or seq_length)
    cfg = _sft_common()
    cfg.model = _tiny_llama(seq_length, vocab_size, num_layers, hidden_size,
                            num_attention_heads, num_query_groups, ffn_hidden_size)
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(write_tokenizer(root / "tokenizer", vocab_size))
    cfg.dataset = GPTSFTDatasetConfig(
        seq_length=seq_length, dataset_root=str(root), enable_offline_packing=True,
        offline_packing_specs=PackedSequenceSpecs(
            packed_sequence_size=seq_length, packed_train_data_path=str(train),
            packed_val_data_path=str(valid)),
        do_validation=False, do_test=False, dataloader_type="single", num_workers=0,
        seed=seed)
    return common_training(cfg, train_iters=train_iters, global_batch_size=global_batch_size,
                           micro_batch_size=1, lr=lr, seed=seed)


def write_packed_sft_data(root: Path, *, seq_length: int, vocab_size: int, rows: int,
                          seed: int, median_length: float, sigma: float, min_length: int,
                          max_length: int) -> tuple[Path, Path]:
    """Packed SFT rows (Bridge's format: ``input_ids``, ``loss_mask``, ``seq_start_id``) in
    Parquet, written with Bridge's ``write_packed_parquet``: sequences of lognormal lengths,
    each a short prompt (no loss) and an answer whose next token mostly follows a fixed
    successor table (learnable), packed first-fit into rows of ``seq_length``. Written once
    (atomically); returns the train and validation files."""
    from megatron.bridge.data.packing.parquet import write_packed_parquet

    root.mkdir(parents=True, exist_ok=True)
    train, valid = root / "train.idx.parquet", root / "valid.idx.parquet"
    if train.is_file() and valid.is_file():
        return train, valid
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab_size - 1)  # the last id is the tokenizer's <eos>
    packed: list[dict[str, list[int]]] = []
    for _ in range(rows):
        ids: list[int] = []
        starts: list[int] = []
        mask: list[int] = []
        while True:
            n = int(np.clip(round(math.exp(rng.normal(math.log(median_length), sigma))),
                            min_length, max_length))
            if ids and len(ids) + n > seq_length:
                break
            n = min(n, seq_length - len(ids))
            seq = [int(rng.integers(vocab_size - 1))]
            for _ in range(n - 1):
                nxt = successor[seq[-1]] if rng.random() < 0.85 else rng.integers(vocab_size - 1)
                seq.append(int(nxt))
            prompt = min(2, n - 1)
            starts.append(len(ids))
            ids += seq
            mask += [0] * prompt + [1] * (n - prompt)
            if len(ids) >= seq_length:
                break
        packed.append({"input_ids": ids, "loss_mask": mask, "seq_start_id": starts})
    for path, part in ((train, packed), (valid, packed[:max(1, rows // 8)])):
        # every rank may write the same file at once: each writes its own temporary file and
        # renames it into place atomically (readers see a whole file, whichever rank's)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_packed_parquet(part, tmp)
        tmp.replace(path)
    return train, valid


def write_tokenizer(path: Path, vocab_size: int) -> Path:
    """A word-level Hugging Face tokenizer over ``t0 .. t{V-2}`` and ``<eos>`` (id ``V-1``),
    saved to ``path`` (written once)."""
    if (path / "tokenizer.json").is_file():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>",
                            unk_token="t0").save_pretrained(str(tmp))
    try:
        tmp.rename(path)  # atomic; another rank that renamed first wins
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "tokenizer.json").is_file():
            raise
    return path
