"""The LSE merge fused by torch.compile (megatron_hcp.attention.reference.merge), here on the
CPU through inductor's C++ code (tests/gpu runs it through Triton): the same results as the
eager merge, one generated kernel a merge, every oracle case of a comm type with it, and the
``MEGATRON_HCP_FUSED_MERGE`` switch. Compiling starts inductor's compile worker processes, so
the tests that compile are ``multirank``."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megatron_hcp.attention.reference import BlockCounter, CPAttentionError, local_attention
from megatron_hcp.attention.reference import merge as merge_module
from megatron_hcp.attention.reference.block_cost import measure_block_cost, rank_block_pass
from megatron_hcp.attention.reference.merge import (
    FUSED_MERGE_ENV,
    fuses,
    merge_into,
    merge_mode,
    merging,
)
from megatron_hcp.threaded_world import ThreadedWorld
from tests.unit.attention.test_cp_attention import (
    WORLD,
    failures_of,
    matrix_cases,
    run_cases,
    window_cases,
)

NEG_INF = float("-inf")


def generated_kernels(code: list[str]) -> list[str]:
    """The kernels in inductor's generated code (C++ on the CPU, Triton on CUDA)."""
    return re.findall(r"^(\w+) = async_compile\.\w+\(", "\n".join(code), flags=re.M)


def _problem(dtype, block_dtype, by_index, seed=0, s=20, device="cpu"):
    """Accumulators [B,H,S,D] in [B,S,H,D] memory (as the backend holds them) with some rows
    not reached yet (LSE -inf), a block of half the rows with some rows it does not reach, and
    the block's rows (a slice, or an index)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d = 2, 3, 8
    out = torch.randn(b, s, h, d, generator=gen, dtype=dtype).permute(0, 2, 1, 3)
    lse = torch.randn(b, h, s, generator=gen, dtype=dtype)
    out_blk = torch.randn(b, h, s // 2, d, generator=gen, dtype=dtype).to(block_dtype)
    lse_blk = torch.randn(b, h, s // 2, generator=gen, dtype=dtype)
    rows = torch.arange(1, s, 2) if by_index else slice(s // 2, s)
    at = rows if by_index else torch.arange(s)[rows]
    lse[:, :, at[:3]] = NEG_INF  # rows no block reached before this one
    out[:, :, at[:3]] = 0.0
    lse_blk[:, :, 1:5] = NEG_INF  # rows this block does not reach (two reached by neither)
    out_blk[:, :, 1:5] = 0.0
    if device != "cpu":  # the same values and memory orders there
        out = out.permute(0, 2, 1, 3).to(device).permute(0, 2, 1, 3)
        lse, out_blk, lse_blk = (t.to(device) for t in (lse, out_blk, lse_blk))
        rows = rows.to(device) if by_index else rows
    return out, lse, rows, out_blk, lse_blk


@pytest.mark.multirank
@pytest.mark.parametrize("dtype,block_dtype,by_index", [
    (torch.float64, torch.float64, False),
    (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.float32, True),
])
def test_the_fused_merge_is_the_eager_merge(monkeypatch, dtype, block_dtype, by_index):
    """The compiled merge writes what the eager one writes (to a few ulps: its exp and sigmoid
    are vectorised), rows no key reached staying output 0 and LSE -inf, with no NaN, and each
    merge is counted as the path it took."""
    want_out, want_lse, rows, out_blk, lse_blk = _problem(dtype, block_dtype, by_index)
    got_out, got_lse = want_out.clone(), want_lse.clone()
    monkeypatch.setenv(FUSED_MERGE_ENV, "off")
    with BlockCounter() as eager:
        merge_into(want_out, want_lse, rows, out_blk, lse_blk)
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    with BlockCounter() as fused:
        merge_into(got_out, got_lse, rows, out_blk, lse_blk)
    assert (eager.merges, fused.merges) == ({"eager": 1}, {"fused": 1})
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    assert got_out.stride() == want_out.stride()  # written in place, in the same memory
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse, rtol=tol, atol=tol)
    assert torch.equal(got_lse.isneginf(), want_lse.isneginf()) and got_lse.isneginf().any()


@pytest.mark.multirank
@pytest.mark.parametrize("by_index", [False, True])
def test_a_fused_merge_is_one_kernel_for_every_block_size(by_index):
    """What inductor generates for a merge: one kernel (the gather and scatters of index rows
    included); a block of another size runs it again without compiling (dynamic shapes)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # compile afresh here, whatever ran before in this process
    key = ("index" if by_index else "rows", True)
    fn = torch.compile(merge_module._FUSED[key], dynamic=True, fullgraph=True)

    def args(seq):
        out, lse, rows, out_blk, lse_blk = _problem(torch.float32, torch.bfloat16, by_index,
                                                    s=seq)
        if by_index:
            return out, lse, rows, out_blk, lse_blk
        return out[:, :, rows], lse[:, :, rows], out_blk, lse_blk

    _, code = run_and_get_code(fn, *args(20))
    kernels = generated_kernels(code)
    assert len(kernels) == 1 and kernels[0].startswith("cpp_fused_"), kernels
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    fn(*args(26))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


@pytest.fixture(scope="module")
def threads():
    with ThreadedWorld(WORLD, device="cpu") as world:
        yield world


@pytest.mark.multirank
@pytest.mark.parametrize("cases", ["p2p-window", "p2p-thd", "a2a+p2p-bshd"])
def test_oracle_cases_with_the_fused_merge(threads, monkeypatch, cases):
    """CP attention with every merge fused (rank threads of this process, as tests/gpu runs
    on one GPU) against the single-process oracle, outputs and gradients at the eager
    tolerances: windows (index rows, rows no key reaches), packed thd (masked halves), the
    dense ring after an a2a."""
    comm, what = cases.rsplit("-", 1)
    chosen = window_cases(comm) if what == "window" else matrix_cases(comm, what)
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    per_rank = threads.run(_fused_cases, chosen)
    assert not (bad := failures_of(chosen, [errors for errors, _ in per_rank])), bad[:8]
    merges = sum((paths for _, paths in per_rank), start=BlockCounter().merges)
    assert merges["fused"] > 0 and not merges["eager"], merges


def _fused_cases(cases):
    with BlockCounter() as counter:
        errors = run_cases(cases)
    return errors, counter.merges


def test_the_switch_reads_auto_on_and_off(monkeypatch):
    """Unset: auto (eager on the CPU, which has no Triton); on / off in any case and spacing;
    anything else is refused naming the variable, the value and the choices."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    assert (merge_mode(), fuses(cpu)) == ("auto", False)
    for value, mode, fused in ((" On ", "on", True), ("OFF", "off", False),
                               ("auto", "auto", False)):
        monkeypatch.setenv(FUSED_MERGE_ENV, value)
        assert (merge_mode(), fuses(cpu)) == (mode, fused)
    monkeypatch.setenv(FUSED_MERGE_ENV, "yes")
    with pytest.raises(CPAttentionError, match=r"MEGATRON_HCP_FUSED_MERGE='yes': use auto .* on "
                                               r".* or off .*unset it for auto"):
        merge_mode()


def test_a_bad_switch_is_refused_before_the_attention_runs(monkeypatch):
    """The attention checks the switch with its other inputs, before any communication."""
    q = torch.randn(1, 8, 2, 4)
    monkeypatch.setenv(FUSED_MERGE_ENV, "fast")
    with pytest.raises(CPAttentionError, match="MEGATRON_HCP_FUSED_MERGE='fast'"):
        local_attention(q, q, q)


def test_auto_merges_eagerly_when_compiling_fails(monkeypatch):
    """``auto`` on a machine where the compile fails: one warning naming the error and the
    switch, then eager merges (no further attempt); ``on`` raises the error instead."""
    def broken(*args):
        raise RuntimeError("no C compiler")

    compiled = merge_module._Compiled()
    monkeypatch.setattr(merge_module, "_compiled", lambda: compiled)
    monkeypatch.setattr(compiled, "_fn", lambda key: broken)
    monkeypatch.setattr(merge_module, "_triton_runs", lambda: True)
    meta = torch.device("meta")
    monkeypatch.setenv(FUSED_MERGE_ENV, "auto")
    assert fuses(torch.device("cuda", 0)) and not fuses(meta)
    out, lse, rows, out_blk, lse_blk = _problem(torch.float64, torch.float64, False)
    with pytest.warns(RuntimeWarning, match=r"did not compile here \(RuntimeError: no C "
                                            r"compiler\).*MEGATRON_HCP_FUSED_MERGE=off"):
        assert not compiled.run(("rows", True), out[:, :, rows], lse[:, :, rows], out_blk,
                                lse_blk)
    assert compiled.failed and not fuses(torch.device("cuda", 0))
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    with pytest.raises(RuntimeError, match="no C compiler"):
        compiled.run(("rows", True), out[:, :, rows], lse[:, :, rows], out_blk, lse_blk)


def test_merges_past_the_recompile_limit_run_eagerly(monkeypatch):
    """Dynamo refusing another compiled variant (its recompile limit) makes that call eager,
    with one warning, and does not turn the fused merge off for the variants it has."""
    def at_limit(*args):
        raise RuntimeError("Dynamo recompile limit exceeded (recompile_limit = 8)")

    compiled = merge_module._Compiled()
    monkeypatch.setattr(compiled, "_fn", lambda key: at_limit)
    monkeypatch.setenv(FUSED_MERGE_ENV, "on")
    out, lse, rows, out_blk, lse_blk = _problem(torch.float64, torch.float64, False)
    with pytest.warns(RuntimeWarning, match="reached torch._dynamo's recompile limit") as seen:
        for _ in range(3):
            assert not compiled.run(("rows", True), out[:, :, rows], lse[:, :, rows],
                                    out_blk, lse_blk)
    assert len(seen) == 1 and not compiled.failed


@pytest.mark.multirank
def test_the_block_replay_times_either_merge(monkeypatch):
    """benchmarks/attention.py --device cuda times each row with two merges in one run: the
    replay (rank_block_pass) gives the same output and gradients with either, its cost says
    which path every merge took, and the switch is as it was afterwards."""
    monkeypatch.setenv(FUSED_MERGE_ENV, "off")
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 4, 64, 8, generator=gen) for _ in range(4))
    with merging("on"):
        fused = rank_block_pass(q, k, v, dout, 4, 1, window=(9, 0))
    eager = rank_block_pass(q, k, v, dout, 4, 1, window=(9, 0))
    for got, want in zip(fused, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cost = measure_block_cost(seq=64, heads=4, kv_heads=4, dim=8, cp=4, dtype=torch.float32,
                              device="cpu", repeats=1, merge="on")
    assert cost.merges == {"fused": 4 * 3} and os.environ[FUSED_MERGE_ENV] == "off"
    with pytest.raises(CPAttentionError, match="merge mode 'fast': use one of auto, on, off"):
        measure_block_cost(seq=64, heads=4, kv_heads=4, dim=8, cp=4, dtype=torch.float32,
                           device="cpu", merge="fast")
