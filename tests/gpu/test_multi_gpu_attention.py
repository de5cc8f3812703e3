"""2-8 GPUs: every comm type over NCCL (one process per GPU) against the oracle, and the
``te-attention-hcp`` wrappers (megatron's TEDotProductAttention with the project's CP groups)
against the reference backend on the same inputs where Transformer Engine imports."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.harness.local_world import LocalWorld
from tests.gpu._need import gpu_count, needs
from tests.unit.attention.test_cp_attention import (
    COMMS,
    TOL,
    all_oracle_cases,
    failures_of,
    run_cases,
    runnable_in,
)

pytestmark = [pytest.mark.gpu, needs(2)]
TE_TOLS = {torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2),  # Transformer Engine's CP tests
           torch.float16: dict(atol=5e-3, rtol=5e-3)}


def nccl_world_size() -> int:
    """4 ranks where there are 4 GPUs (every oracle case fits), else 2."""
    return 4 if gpu_count() >= 4 else 2


@pytest.fixture(scope="module")
def nccl_world():
    with LocalWorld(nccl_world_size(), backend="nccl", timeout_s=600) as world:
        yield world


@pytest.mark.parametrize("name", sorted(all_oracle_cases()))
def test_comm_types_over_nccl_against_the_oracle(nccl_world, report, name):
    """The oracle cases of test_cp_attention that fit the NCCL world (one GPU per rank), same
    tolerances as on CPU."""
    cases = runnable_in(all_oracle_cases()[name], nccl_world.world_size)
    if not cases:
        pytest.skip(f"needs 4 CUDA GPUs: these cases run CP 4; this machine has {gpu_count()}")
    per_rank = nccl_world.run(run_cases, cases, "cuda")
    worst: dict = {}
    for results in per_rank:
        for case, errors in zip(cases, results):
            worst[case[5]] = max(worst.get(case[5], 0.0), *errors.values())
    report(nccl_world.world_size, f"{len(cases)} cases over NCCL; max error " + ", ".join(
        f"{str(dt).removeprefix('torch.')} {e:.1e} (tol {TOL[dt]:.0e})"
        for dt, e in sorted(worst.items(), key=str)))
    assert not (bad := failures_of(cases, per_rank)), bad[:8]


def te_against_reference(comm: str, dtype: torch.dtype, device: str = "cuda",
                         backends: tuple[str, str] = ("te", "reference")) -> dict:
    """One rank: megatron's MPU groups with CP = the world, TEDotProductAttention (patched by
    te-attention-hcp) and ReferenceCPAttention built alike, the same sbhd shards in; the
    largest |TE - reference| of the output and of dq, dk, dv, and the tolerance check.
    (``backends``/``device`` let the same code run twice-reference on CPU ranks.)"""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hcp.attention.module import ReferenceCPAttention
    from megatron_hcp.attention.reference import get_local_chunk
    from megatron_hcp.attention.te import te_attention_class
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply, by_name

    if "te" in backends:
        apply(by_name(["te-attention-hcp"]))
    cp = dist.get_world_size()
    hcp = [2, cp // 2] if comm == "a2a+p2p" else None
    heads, kv_heads, dim, seq, batch = 8, 4, 64, 512 * cp, 2
    initialize_model_parallel(CPConfig(
        context_parallel_size=cp, cp_comm_type=comm, hierarchical_context_parallel_sizes=hcp,
        num_attention_heads=heads, num_query_groups=kv_heads, seq_length=seq),
        create_gloo_process_groups=False)
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
            num_query_groups=kv_heads, context_parallel_size=cp, cp_comm_type=comm,
            hierarchical_context_parallel_sizes=hcp, attention_dropout=0.0,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        gen = torch.Generator().manual_seed(7)
        full = [torch.randn(seq, batch, h, dim, generator=gen) for h in
                (heads, kv_heads, kv_heads)]
        dout = torch.randn(seq, batch, heads * dim, generator=gen)
        rank = dist.get_rank()
        results = {}
        for label, backend in enumerate(backends):
            cls = te_attention_class() if backend == "te" else ReferenceCPAttention
            module = cls(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm)
            local = [get_local_chunk(x, cp, rank, "sbhd").to(device, dtype).requires_grad_()
                     for x in full]
            out = module(*local, None, AttnMaskType.causal)
            out.backward(get_local_chunk(dout, cp, rank, "sbhd").to(device, dtype))
            results[label] = [out.detach(), *(t.grad for t in local)]
        tols = TE_TOLS[dtype]
        diffs = {key: (a.float() - b.float()).abs().max().item()
                 for key, a, b in zip(("out", "dq", "dk", "dv"), results[0], results[1])}
        close = all(torch.allclose(a.float(), b.float(), **tols)
                    for a, b in zip(results[0], results[1]))
        return {"diffs": diffs, "close": close}
    finally:
        destroy_model_parallel()


@needs(2, te=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("comm", COMMS)
def test_te_wrappers_against_the_reference_backend(nccl_world, report, comm, dtype):
    if comm == "a2a+p2p" and nccl_world.world_size < 4:
        pytest.skip(f"needs 4 CUDA GPUs: a2a+p2p [2, 2]; this machine has {gpu_count()}")
    results = nccl_world.run(te_against_reference, comm, dtype)
    worst = {k: max(r["diffs"][k] for r in results) for k in ("out", "dq", "dk", "dv")}
    report(nccl_world.world_size, "max |TE - reference| " + ", ".join(
        f"{k} {v:.1e}" for k, v in worst.items()) + f" (TE's tolerances {TE_TOLS[dtype]})")
    assert all(r["close"] for r in results), worst
