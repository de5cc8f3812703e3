"""The pieces of megatron-hcp's Bridge glue that need no Bridge: one micro-batch of Bridge's
data cut into the sequences the dynamic-CP scheduler places, and the checks of a Bridge config
before any process group (both stacks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_hcp.bridge.config import cp_config_from_bridge
from megatron_hcp.bridge.dynamic_cp import bridge_batch_samples, cp_config_of, prepare_config
from megatron_hcp.config import CPConfigError


def _row(length: int, offset: int = 0) -> dict:
    tokens = torch.arange(offset, offset + length).unsqueeze(0)
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": torch.ones(1, length),
            "position_ids": torch.arange(length).unsqueeze(0)}


def test_a_row_without_packing_metadata_is_one_sample():
    (sample,) = bridge_batch_samples(_row(6))
    assert sample.dtype == torch.int64 and sample.shape == (3, 6)
    assert sample[0].tolist() == list(range(6)) and sample[1, 0] == 1000
    assert sample[2].tolist() == [1] * 6


def test_packed_rows_are_cut_at_their_logical_boundaries_padding_and_empty_ones_dropped():
    """Bridge's packed SFT batch: ``cu_seqlens_q`` logical ends, ``cu_seqlens_q_padded`` the
    physical ones (alignment padding after each sequence), rows of one micro-batch padded with
    zero-length sequences; a sequence with no loss token is left out."""
    batch = _row(16)
    batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 0]])
    batch["loss_mask"][0, 9:12] = 0  # the third sequence (9..11) has no loss token
    batch["cu_seqlens_q"] = torch.tensor([[0, 3, 8, 11, 14, 14]])
    batch["cu_seqlens_q_padded"] = torch.tensor([[0, 4, 9, 12, 16, 16]])
    samples = bridge_batch_samples(batch)
    assert [s[0].tolist() for s in samples] == [[0, 1, 2], [4, 5, 6, 7, 8], [12, 13, 14]]


def test_legacy_cu_seqlens_stop_at_the_sentinel():
    batch = _row(10)
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    batch["cu_seqlens"] = torch.tensor([[0, 4, 10, -1, -1]])
    assert [s.shape[1] for s in bridge_batch_samples(batch)] == [4, 6]


def test_positions_that_restart_inside_a_sequence_are_refused():
    """reset_position_ids inside one attention span cannot be a packed sequence's positions."""
    batch = _row(8)
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="reset_position_ids"):
        bridge_batch_samples(batch)


def test_weighted_loss_masks_are_refused():
    batch = _row(4)
    batch["loss_mask"] = torch.tensor([[1.0, 0.5, 1.0, 1.0]])
    with pytest.raises(ValueError, match="loss_mask must be 0 or 1"):
        bridge_batch_samples(batch)


# ------------------------------------------------------------------------------ configs
def _model(**fields) -> SimpleNamespace:
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, cp_comm_type=None,
                hierarchical_context_parallel_sizes=None, num_attention_heads=4,
                num_query_groups=2, num_layers=2, seq_length=128, hybrid_context_parallel=False,
                max_seqlen_per_dp_cp_rank=None, calculate_per_token_loss=True,
                cuda_graph_impl="none", sequence_parallel=False, variable_seq_lengths=False)
    return SimpleNamespace(**{**base, **fields})


def _cfg(**fields) -> SimpleNamespace:
    return SimpleNamespace(model=_model(**fields), dist=SimpleNamespace(use_megatron_fsdp=False))


def test_a_dynamic_config_is_taken_over_from_megatron_with_both_names():
    cfg = _cfg(context_parallel_size=2, hybrid_context_parallel=True,
               max_seqlen_per_dp_cp_rank=64)
    config = prepare_config(cfg, world_size=4)
    assert config.dynamic and config.dp_cp_size == 4
    assert cfg.model.hybrid_context_parallel is False  # megatron's own schedule never runs
    assert cp_config_of(cfg.model) is config
    assert prepare_config(cfg, world_size=4) is config  # prepared once
    dev = _cfg(context_parallel_size=2, max_seqlen_per_dp_cp_rank=64)
    dev.model.dynamic_context_parallel = True  # the development branch's name, as an attribute
    dev.model.min_dynamic_context_parallel_size = 2
    config = prepare_config(dev, world_size=4)
    assert config.dynamic and config.min_dynamic_context_parallel_size == 2
    assert dev.model.dynamic_context_parallel is False


@pytest.mark.parametrize("fields, named", [
    (dict(context_parallel_size=4, cp_comm_type="p2p",
          hierarchical_context_parallel_sizes=[2, 2]), "hierarchical_context_parallel_sizes"),
    (dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64,
          calculate_per_token_loss=False), "calculate_per_token_loss"),
    (dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=31),
     "model.max_seqlen_per_dp_cp_rank"),  # 128 tokens on 4 ranks need 32 each
    (dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64,
          pipeline_model_parallel_size=2), "model.variable_seq_lengths"),
    (dict(context_parallel_size="2"), "model.context_parallel_size"),
    (dict(context_parallel_size=4.9), "model.context_parallel_size"),
    (dict(hierarchical_context_parallel_sizes=4), "model.hierarchical_context_parallel_sizes"),
])
def test_bad_configs_are_named_errors(fields, named):
    with pytest.raises(CPConfigError) as info:
        prepare_config(_cfg(**fields), world_size=4)
    assert any(named in v.parameter for v in info.value.violations), info.value


def test_the_cap_check_counts_sequence_parallel_padding():
    """With SP each packed sequence is padded to 2 x CP x TP: 128 tokens on DPxCP 2 with TP 2
    hold 64 per rank, 132 need 68 (136 after padding)."""
    fine = _cfg(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64)
    assert prepare_config(fine, world_size=4).dynamic
    long = _cfg(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=64, seq_length=132)
    with pytest.raises(CPConfigError, match="needs 68 tokens per rank"):
        prepare_config(long, world_size=4)


def test_one_replica_is_the_default_world():
    config = cp_config_from_bridge(_model(tensor_model_parallel_size=2, context_parallel_size=2))
    assert config.world_size == 4 and config.data_parallel_size == 1


def test_the_partition_layout_is_read_and_bridges_static_cp_refuses_contiguous():
    """model.cp_partition_mode (upstream's name, an attribute on 0.19's provider) reaches the
    CPConfig; Bridge's own batch step cuts zigzag, so static CP in the contiguous layout is a
    named error, while dynamic CP (megatron-hcp packs the batches) takes it."""
    config = cp_config_from_bridge(_model(context_parallel_size=2, cp_partition_mode="contiguous"))
    assert config.cp_partition_mode == "contiguous"
    with pytest.raises(CPConfigError) as info:
        prepare_config(_cfg(context_parallel_size=2, cp_partition_mode="contiguous"),
                       world_size=4)
    (v,) = info.value.violations
    assert v.parameter == "model.cp_partition_mode" and "zigzag" in v.rule
    dynamic = prepare_config(_cfg(context_parallel_size=2, hybrid_context_parallel=True,
                                  max_seqlen_per_dp_cp_rank=64, cp_partition_mode="contiguous"),
                             world_size=4)
    assert dynamic.dynamic and dynamic.cp_partition_mode == "contiguous"
    with pytest.raises(CPConfigError, match="model.cp_partition_mode"):
        prepare_config(_cfg(context_parallel_size=2, cp_partition_mode=3), world_size=4)
