"""The CP attention's merges and masks fused by torch.compile
(megatron_hcp.attention.reference.gpu.fused), here on the CPU through inductor's C++ code
(tests/gpu runs them through Triton): the same results as the eager ones, one generated kernel
each, oracle cases of every comm type with them, and the ``MEGATRON_HCP_FUSED_OPS`` switch.
Compiling starts inductor's compile worker processes, so the tests that compile are
``multirank``."""

from __future__ import annotations

import functools
import os
import re
import shutil

import pytest
import torch

from megatron_hcp.attention.reference import BlockCounter, CPAttentionError, local_attention
from megatron_hcp.attention.reference import merge as merge_module
from megatron_hcp.attention.reference.block_cost import measure_block_cost, rank_block_pass
from megatron_hcp.attention.reference.gpu import fused as fused_module
from megatron_hcp.attention.reference.gpu.fused import FUSED_ENV, fused_mode, fuses, fusing
from megatron_hcp.attention.reference.masks import BlockMask, _additive_fused
from megatron_hcp.attention.reference.merge import merge_into
from megatron_hcp.harness.threaded_world import ThreadedWorld
from tests.unit.attention.test_cp_attention import (
    WORLD,
    failures_of,
    matrix_cases,
    run_cases,
    window_cases,
)

pytestmark = pytest.mark.torch_only

NEG_INF = float("-inf")
# the C++ compiler inductor's CPU backend calls (its config: $CXX, else g++)
CXX = shutil.which(os.environ.get("CXX", "g++"))


def compiles(test):
    """A test that compiles with inductor on the CPU: ``multirank`` (inductor starts compile
    worker processes), and it needs inductor's C++ compiler (said as the skip reason where none
    is on PATH: then ``MEGATRON_HCP_FUSED_OPS=on`` cannot run on this machine either)."""
    test = pytest.mark.multirank(test)
    return pytest.mark.skipif(CXX is None, reason="inductor's CPU backend needs a C++ compiler "
                              "($CXX or g++); none on PATH")(test)


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


@compiles
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
    monkeypatch.setenv(FUSED_ENV, "off")
    with BlockCounter() as eager:
        merge_into(want_out, want_lse, rows, out_blk, lse_blk)
    monkeypatch.setenv(FUSED_ENV, "on")
    with BlockCounter() as fused:
        merge_into(got_out, got_lse, rows, out_blk, lse_blk)
    assert (eager.merges, fused.merges) == ({"eager": 1}, {"fused": 1})
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse, rtol=tol, atol=tol)
    assert torch.equal(got_lse.isneginf(), want_lse.isneginf()) and got_lse.isneginf().any()


@compiles
@pytest.mark.parametrize("by_index", [False, True])
def test_a_fused_merge_is_one_compiled_function_for_every_block_size(by_index):
    """What inductor generates for a merge: one compiled function (the gather and scatters of
    index rows included; the CPU backend puts every loop of it into one C++ function, how many
    Triton kernels it makes is checked in tests/gpu), over a slice of rows writing the output
    in place (no output-sized buffer); a block of another size runs it again without compiling
    (dynamic shapes)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # compile afresh here, whatever ran before in this process
    key = ("index" if by_index else "rows", True)
    compiled = fused_module._Compiled()  # as production calls it (no grad, no duck sizing)
    fn = functools.partial(compiled._call,
                           torch.compile(merge_module.FUSED[key], dynamic=True, fullgraph=True))

    def args(seq):
        out, lse, rows, out_blk, lse_blk = _problem(torch.float32, torch.bfloat16, by_index,
                                                    s=seq)
        if by_index:
            return out, lse, rows, out_blk, lse_blk
        return out[:, :, rows], lse[:, :, rows], out_blk, lse_blk

    _, code = run_and_get_code(fn, args(20))
    kernels = generated_kernels(code)
    assert len(kernels) == 1 and kernels[0].startswith("cpp_fused_"), kernels
    if not by_index:  # in place: at most the new LSE [B,H,R] is staged, never the output rows
        staged = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", "\n".join(code))
        assert all(len(shape.split(",")) <= 3 for shape in staged), staged
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    fn(args(26))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


@pytest.fixture(scope="module")
def threads():
    with ThreadedWorld(WORLD, device="cpu") as world:
        yield world


@compiles
@pytest.mark.parametrize("cases", ["p2p-window", "p2p-thd", "a2a+p2p-bshd"])
def test_oracle_cases_with_the_fused_merge(threads, monkeypatch, cases):
    """CP attention with every merge and mask fused (rank threads of this process, as
    tests/gpu runs on one GPU) against the single-process oracle, outputs and gradients at the
    eager tolerances: windows (index rows, rows no key reaches), packed thd (masked halves),
    the dense ring after an a2a (no mask)."""
    comm, what = cases.rsplit("-", 1)
    chosen = window_cases(comm) if what == "window" else matrix_cases(comm, what)
    monkeypatch.setenv(FUSED_ENV, "on")
    per_rank = threads.run(_fused_cases, chosen)
    assert not (bad := failures_of(chosen, [errors for errors, *_ in per_rank])), bad[:8]
    merges = sum((paths for _, paths, _ in per_rank), start=BlockCounter().merges)
    masks = sum((paths for *_, paths in per_rank), start=BlockCounter().masks)
    assert merges["fused"] > 0 and not merges["eager"], merges
    assert (masks["fused"] > 0) == (what != "bshd") and not masks["eager"], masks


def _fused_cases(cases):
    with BlockCounter() as counter:
        errors = run_cases(cases)
    return errors, counter.merges, counter.masks


def test_the_switch_reads_auto_on_and_off(monkeypatch):
    """Unset: auto (eager on the CPU, which has no Triton); on / off in any case and spacing;
    anything else is refused naming the variable, the value and the choices."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(FUSED_ENV, raising=False)
    assert (fused_mode(), fuses(cpu)) == ("auto", False)
    for value, mode, fused in ((" On ", "on", True), ("OFF", "off", False),
                               ("auto", "auto", False)):
        monkeypatch.setenv(FUSED_ENV, value)
        assert (fused_mode(), fuses(cpu)) == (mode, fused)
    monkeypatch.setenv(FUSED_ENV, "yes")
    with pytest.raises(CPAttentionError, match=r"MEGATRON_HCP_FUSED_OPS='yes': use auto .* on "
                                               r".* or off .*unset it for auto"):
        fused_mode()


def test_a_bad_switch_is_refused_before_the_attention_runs(monkeypatch):
    """The attention checks the switch with its other inputs, before any communication."""
    q = torch.randn(1, 8, 2, 4)
    monkeypatch.setenv(FUSED_ENV, "fast")
    with pytest.raises(CPAttentionError, match="MEGATRON_HCP_FUSED_OPS='fast'"):
        local_attention(q, q, q)


def test_auto_works_eagerly_when_compiling_fails(monkeypatch):
    """``auto`` on a machine where the compile fails: one warning naming the error and the
    switch, then eager merges and masks (no further attempt); ``on`` raises the error
    instead."""
    def broken(*args):
        raise RuntimeError("no C compiler")

    compiled = fused_module._Compiled()
    monkeypatch.setattr(fused_module, "_compiled", lambda: compiled)
    monkeypatch.setattr(compiled, "_fn", lambda fn: broken)
    monkeypatch.setattr(fused_module, "_triton_runs", lambda: True)
    meta = torch.device("meta")
    monkeypatch.setenv(FUSED_ENV, "auto")
    assert fuses(torch.device("cuda", 0)) and not fuses(meta)
    out, lse, rows, out_blk, lse_blk = _problem(torch.float64, torch.float64, False)
    args = (out[:, :, rows], lse[:, :, rows], out_blk, lse_blk)
    with pytest.warns(RuntimeWarning, match=r"did not compile here \(RuntimeError: no C "
                                            r"compiler\).*MEGATRON_HCP_FUSED_OPS=off"):
        assert compiled.run(merge_module.FUSED["rows", True], args) == (False, None)
    assert compiled.failed and not fuses(torch.device("cuda", 0))
    monkeypatch.setenv(FUSED_ENV, "on")
    fresh = fused_module._Compiled()
    monkeypatch.setattr(fresh, "_fn", lambda fn: broken)
    with pytest.raises(RuntimeError, match="no C compiler"):
        fresh.run(merge_module.FUSED["rows", True], args)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test (which fills them, or limits them)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@compiles
def test_a_function_past_the_recompile_limit_stays_eager(monkeypatch, fresh_dynamo):
    """Dynamo refusing another compiled variant (its real recompile limit, set to 1 here)
    makes that call eager with one warning, and the function eager from then on - also for
    the variant it had - without asking dynamo again (each refused call costs it a
    millisecond and a log); other functions still fuse."""
    compiled = fused_module._Compiled()
    monkeypatch.setenv(FUSED_ENV, "on")
    fn = merge_module.FUSED["rows", True]

    def args(dtype):
        out, lse, rows, out_blk, lse_blk = _problem(dtype, dtype, False)
        return out[:, :, rows], lse[:, :, rows], out_blk, lse_blk

    with torch._dynamo.config.patch(recompile_limit=1):
        assert compiled.run(fn, args(torch.float64))[0]
        with pytest.warns(RuntimeWarning, match=r"fused _fused_rows_masked reached "
                                                r"torch._dynamo's recompile limit") as seen:
            assert compiled.run(fn, args(torch.float32)) == (False, None)
            assert compiled.run(fn, args(torch.float64)) == (False, None)
        assert len(seen) == 1 and not compiled.failed
        assert compiled.run(merge_module.FUSED["rows", False], args(torch.float64))[0]


def test_errors_of_running_are_raised_and_compile_errors_of_a_new_variant_fall_back(
        monkeypatch):
    """After fusing worked once, ``auto`` makes a function eager for good on its compile error
    (dynamo's exception types: not compiled again on every call) and raises an error of
    running; out-of-memory is raised even on the first call, and does not turn fusing off."""
    from torch._dynamo.exc import TorchDynamoException

    monkeypatch.setenv(FUSED_ENV, "auto")
    errors = iter([torch.OutOfMemoryError("out of memory"), None,
                   TorchDynamoException("a new variant failed"), RuntimeError("bad launch")])

    def step(*args):
        err = next(errors)
        if err is not None:
            raise err
        return "done"

    compiled = fused_module._Compiled()
    monkeypatch.setattr(compiled, "_fn", lambda fn: step)
    with pytest.raises(torch.OutOfMemoryError):
        compiled.run(merge_into, ())
    assert not compiled.failed and compiled.run(merge_into, ()) == (True, "done")
    with pytest.warns(RuntimeWarning, match="a new variant failed.*eagerly from now on"):
        assert compiled.run(fuses, ()) == (False, None)
    # that function is not compiled again (each attempt costs seconds); fusing stays on
    assert compiled.run(fuses, ()) == (False, None) and not compiled.failed
    with pytest.raises(RuntimeError, match="bad launch"):
        compiled.run(merge_into, ())


def test_auto_fuses_blocks_large_enough_on_cuda_only(monkeypatch):
    """``auto`` fuses CUDA work of at least MIN_FUSED_ELEMENTS elements where Triton runs:
    smaller blocks save less launch time than a compiled call costs on the host."""
    monkeypatch.setattr(fused_module, "_triton_runs", lambda: True)
    monkeypatch.setattr(fused_module, "_compiled", lambda: fused_module._Compiled())
    monkeypatch.setenv(FUSED_ENV, "auto")
    cuda, least = torch.device("cuda", 0), fused_module.MIN_FUSED_ELEMENTS
    assert fuses(cuda, least) and fuses(cuda) and not fuses(cuda, least - 1)
    assert not fuses(torch.device("cpu"), least)
    monkeypatch.setenv(FUSED_ENV, "on")
    assert fuses(cuda, 1) and fuses(torch.device("cpu"), 1)


@compiles
def test_the_block_replay_times_either_mode(monkeypatch):
    """benchmarks/attention.py --device cuda times each row eager and fused in one run: the
    replay (rank_block_pass) gives the same output and gradients with either, its cost says
    which path every merge and mask took, and the switch is as it was afterwards."""
    monkeypatch.setenv(FUSED_ENV, "off")
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 4, 64, 8, generator=gen) for _ in range(4))
    with fusing("on"):
        fused = rank_block_pass(q, k, v, dout, 4, 1, window=(9, 0))
    eager = rank_block_pass(q, k, v, dout, 4, 1, window=(9, 0))
    for got, want in zip(fused, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cost = measure_block_cost(seq=64, heads=4, kv_heads=4, dim=8, cp=4, dtype=torch.float32,
                              device="cpu", repeats=1, fused="on", window=(9, 0))
    # every block computed builds its mask forward and backward; every rank merges all its
    # blocks but its first
    blocks = sum(cost.kernels.values())
    assert blocks > 4 and cost.masks == {"fused": 2 * blocks}, cost
    assert cost.merges == {"fused": blocks - 4}, cost
    assert os.environ[FUSED_ENV] == "off"
    with pytest.raises(CPAttentionError, match="fused mode 'fast': use one of auto, on, off"):
        measure_block_cost(seq=64, heads=4, kv_heads=4, dim=8, cp=4, dtype=torch.float32,
                           device="cpu", fused="fast")


def _meta(n, gen, positions):
    return (torch.randint(0, 3, (n,), generator=gen), torch.randint(0, positions, (n,),
            generator=gen), torch.rand(n, generator=gen) > 0.2)


@compiles
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (5, 0), (3, 4), (-1, 2), (6, -1)])
def test_the_fused_mask_is_the_eager_mask(monkeypatch, causal, window):
    """A masked block's additive mask built by the fused kernel from its tokens' metadata is,
    value for value, the eager one (0 where the boolean mask shows a visible pair, -inf
    elsewhere), rows ``width`` apart as the CUDA kernels want them, with the same rows that
    see no key; a row of padding or a sequence absent from the keys sees none."""
    gen = torch.Generator().manual_seed(7)
    mask = BlockMask(_meta(12, gen, 20), _meta(21, gen, 20), causal, window)
    want = mask.dense()
    assert want.any() and not want.all(1).all()
    for dtype, width in ((torch.bfloat16, 32), (torch.float32, 21)):
        monkeypatch.setenv(FUSED_ENV, "off")
        with BlockCounter() as eager:
            add, seen = mask.additive(dtype, width)
        monkeypatch.setenv(FUSED_ENV, "on")
        with BlockCounter() as fused:
            got, got_seen = mask.additive(dtype, width)
        assert (eager.masks, fused.masks) == ({"eager": 1}, {"fused": 1})
        assert got.dtype == dtype and got.shape == (12, 21) and got.stride() == (width, 1)
        assert torch.equal(got, add) and torch.equal(got == 0, want)
        assert torch.equal(got_seen, seen) and torch.equal(seen, want.any(1))


@compiles
def test_a_fused_mask_is_one_kernel_without_a_buffer_between():
    """What inductor generates for a block's additive mask (rows padded to a width) and its
    rows that see a key: one function over one [rows, width] range, allocating only its two
    outputs (no [rows, cols] buffer written and read back to pad)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = fused_module._Compiled()
    fn = functools.partial(compiled._call,
                           torch.compile(_additive_fused, dynamic=True, fullgraph=True))
    gen = torch.Generator().manual_seed(8)
    (add, seen), code = run_and_get_code(fn, (*_meta(12, gen, 20), *_meta(21, gen, 20), 5, 0,
                                              32, torch.bfloat16))
    kernels = generated_kernels(code)
    assert len(kernels) == 1 and kernels[0].startswith("cpp_fused_"), kernels
    assert "\n".join(code).count("empty_strided_cpu(") == 2, "a buffer besides the outputs"
    assert add.shape == (12, 21) and add.stride() == (32, 1) and seen.shape == (12,)


@compiles
def test_fused_work_stays_eager_under_dispatch_modes_and_other_compiles(monkeypatch):
    """Even with ``on``: under a Python dispatch mode (the launch counter here; a FLOP counter,
    a fake-tensor trace) the merge runs eagerly, its ops seen by the mode; inside the caller's
    own torch.compile it is traced eagerly into that graph; both give the merge's values."""
    from megatron_hcp.attention.reference.launches import count_launches

    monkeypatch.setenv(FUSED_ENV, "on")
    out, lse, rows, out_blk, lse_blk = _problem(torch.float64, torch.float64, False)
    want_out, want_lse = out.clone(), lse.clone()
    with fusing("off"):
        merge_into(want_out, want_lse, rows, out_blk, lse_blk)
    counted_out, counted_lse = out.clone(), lse.clone()
    with BlockCounter() as counter:
        _, launched = count_launches(merge_into, counted_out, counted_lse, rows, out_blk,
                                     lse_blk)
    assert counter.merges == {"eager": 1} and launched.kernels >= 4, launched.line()

    def caller(o, m, ob, lb):
        merge_into(o, m, rows, ob, lb)
        return o.sum()

    traced_out, traced_lse = out.clone(), lse.clone()
    total = torch.compile(caller)(traced_out, traced_lse, out_blk, lse_blk)
    for got_out, got_lse in ((counted_out, counted_lse), (traced_out, traced_lse)):
        torch.testing.assert_close(got_out, want_out, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(total, want_out.sum(), rtol=1e-12, atol=1e-12)


def test_disabled_torch_compile_fuses_nothing(monkeypatch):
    """``TORCH_COMPILE_DISABLE`` / ``TORCHDYNAMO_DISABLE``: torch.compile would run the
    functions uncompiled, so nothing is fused (nor recorded as fused)."""
    monkeypatch.setenv(FUSED_ENV, "on")
    assert fuses(torch.device("cpu"))
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert not fuses(torch.device("cpu"))
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    with torch._dynamo.config.patch(disable=True):
        assert not fuses(torch.device("cpu"))
    assert fuses(torch.device("cpu"))


def test_auto_on_the_cpu_asks_nothing_of_torch_compile(monkeypatch):
    """``auto`` on the CPU decides from the device alone: it neither asks torch.compile's
    switches (whose import, torch._dynamo, costs a second per process) nor the GPU."""
    def asked():
        raise AssertionError("auto on the CPU asked torch.compile or CUDA")

    monkeypatch.setattr(fused_module, "_compile_disabled", asked)
    monkeypatch.setattr(fused_module, "_capturing", asked)
    monkeypatch.setattr(fused_module, "_triton_runs", asked)
    monkeypatch.setenv(FUSED_ENV, "auto")
    assert not fuses(torch.device("cpu"), 1 << 30)
