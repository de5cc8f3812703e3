"""megatron's ``calculate_per_token_loss=False`` (a mean per micro-batch) is honoured and equals
CP=1 under CP: the micro-batch's tokens are counted over its whole CP group, never per rank
(the class of bug Megatron-LM #7452 describes), so uneven loss masks and a CP rank whose chunks
are all masked change nothing. Real megatron-core schedules, DDP and optimizer on 4 gloo ranks;
the oracle is megatron's own non-per-token path without CP (CP=1, the same micro-batches)."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.config import CPConfigError

WORLD = 4
RTOL = 1e-5


def uneven_mask(step: int, row: int, length: int) -> torch.Tensor:
    """Loss masks that differ per sequence and per CP rank. Kind 0 masks the first and last
    eighth: with CP4 (8 chunks, rank 0 holds chunks 0 and 7) rank 0 counts no token of that
    sequence; row 5 counts no token at all."""
    mask = torch.ones(length)
    eighth = max(1, length // 8)
    kind = row % 4
    if kind == 0:
        mask[:eighth] = 0
        mask[-eighth:] = 0
    elif kind == 1:
        mask[: 5 * eighth] = 0
    elif kind == 2:
        mask[:2] = 0
    else:
        mask[::3] = 0
    if row == 5:
        mask[:] = 0
    return mask


def train(tp: int, cp: int, pp: int, comm: str, hcp, per_token: bool, varlen: bool = False):
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply_cpu_runtime
    from megatron_hcp.training.trainer import TinyGPTSpec, VarLen, train_tiny_gpt

    apply_cpu_runtime()
    fields = dict(context_parallel_size=cp, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, cp_comm_type=comm,
                  hierarchical_context_parallel_sizes=hcp, num_attention_heads=4,
                  num_query_groups=2, seq_length=64, calculate_per_token_loss=per_token)
    initialize_model_parallel(CPConfig(data_parallel_size=WORLD // (tp * cp * pp), **fields),
                              create_gloo_process_groups=False)
    try:
        return train_tiny_gpt(TinyGPTSpec.of(
            num_layers=4, steps=3, micro_batch_size=1, global_batch_size=8,
            loss_mask=uneven_mask, varlen=VarLen(min_len=16, max_len=64,
                                                 samples_per_micro_batch=2) if varlen else None,
            **fields))
    finally:
        destroy_model_parallel()


def close(run, want) -> bool:
    return all(((torch.tensor(run[k]) - torch.tensor(want[k])).abs()
                / torch.tensor(want[k]).abs()).max() <= RTOL for k in ("loss", "grad_norm"))


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed length", "packed THD"])
@pytest.mark.multirank
def test_non_per_token_loss_is_honoured_and_equals_cp1(world, varlen):
    per_micro_batch = world.run(train, 1, 1, 1, "p2p", None, False, varlen)
    per_token = world.run(train, 1, 1, 1, "p2p", None, True, varlen)
    want = per_micro_batch[0]
    # the setting changes the run: a mean per micro-batch weights tokens unlike a mean per token
    assert abs(want["grad_norm"][0] - per_token[0]["grad_norm"][0]) > 1e-3 * want["grad_norm"][0]
    assert want["loss"][0] == per_token[0]["loss"][0]  # same model, same reported lm loss
    layouts = [(1, 2, 1, "p2p", None), (1, 4, 1, "p2p", None), (1, 4, 1, "a2a+p2p", [2, 2]),
               (2, 2, 1, "all_gather", None)]
    if not varlen:
        layouts.append((1, 2, 2, "a2a", None))
    for tp, cp, pp, comm, hcp in layouts:
        runs = world.run(train, tp, cp, pp, comm, hcp, False, varlen)
        assert all(close(run, want) for run in runs), ((tp, cp, pp, comm), runs[0], want)


def test_dynamic_cp_refuses_non_per_token_loss_before_anything_runs():
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    spec = TinyGPTSpec.of(dynamic_context_parallel=True, calculate_per_token_loss=False,
                          context_parallel_size=2, max_seqlen_per_dp_cp_rank=64)
    with pytest.raises(CPConfigError, match="calculate_per_token_loss=False: dynamic CP needs "
                                            "per-token loss"):
        train_tiny_gpt(spec)  # no process group exists: refused before any collective


def test_extra_config_cannot_override_what_the_spec_sets():
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    spec = TinyGPTSpec.of(extra_config={"calculate_per_token_loss": False})
    with pytest.raises(CPConfigError, match=r"extra_config\['calculate_per_token_loss'\]=False: "
                                            "is set by the trainer"):
        train_tiny_gpt(spec)
