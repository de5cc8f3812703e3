"""Which kernel each CP attention block takes (kernels.choose_kernel / kernel_for) and that the
blocks of real attention calls take it (BlockCounter.kernels), on CPU; no kernel is mocked."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_hcp.attention.reference import BlockCounter, full_attention, local_attention, pad_thd
from megatron_hcp.attention.reference.block_cost import measure_block_cost, rank_block_pass
from megatron_hcp.attention.reference.kernel_support import (
    CPU_FLASH,
    CUDA_EFFICIENT,
    CUDA_FLASH,
    MATH,
    torch_accepts,
)
from megatron_hcp.attention.reference.kernels import (
    KernelChoice,
    block_backward,
    block_forward,
    choose_kernel,
    cpu_flash_takes_grouped_kv,
)
from megatron_hcp.attention.reference.launches import count_launches

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
TOL = {F64: 1e-12, F32: 1e-5}

# (device, dtype, d_qk, d_v, q_len, kv_len, causal, masked, biased) -> kernel, reason fragment
RULES = [
    (("cpu", F32, 64, 64, 8, 8, True, False, False), CPU_FLASH, ""),
    (("cpu", F64, 8, 8, 8, 4, False, False, False), CPU_FLASH, ""),
    (("cpu", F32, 8, 4, 8, 8, True, False, False), MATH, "MLA head dims (d_qk 8, d_v 4)"),
    (("cpu", F32, 8, 8, 8, 8, False, True, False), CPU_FLASH, ""),  # thd / window: a mask
    (("cpu", F32, 8, 4, 8, 8, False, True, False), MATH, "MLA head dims"),  # masked MLA
    (("cpu", F32, 8, 8, 8, 8, False, True, True), MATH, "post-scale bias"),
    (("cpu", F32, 8, 8, 0, 8, False, True, False), MATH, "empty block"),  # CPU flash: SIGFPE
    (("cpu", F64, 8, 8, 8, 0, False, False, False), MATH, "empty block"),
    (("cpu", F32, 8, 8, 8, 8, False, False, True), MATH, "post-scale bias"),
    (("cuda", BF16, 128, 128, 64, 64, True, False, False), CUDA_FLASH, ""),
    (("cuda", F16, 64, 64, 32, 64, False, False, False), CUDA_FLASH, ""),
    (("cuda", BF16, 192, 128, 64, 64, True, False, False), CUDA_EFFICIENT, ""),  # MLA
    (("cuda", BF16, 320, 320, 64, 64, False, False, False), CUDA_EFFICIENT, ""),  # > 256
    (("cuda", F32, 64, 64, 64, 64, True, False, False), CUDA_EFFICIENT, ""),
    (("cuda", F32, 8, 4, 16, 16, False, False, False), CUDA_EFFICIENT, ""),  # MLA, fp32
    (("cuda", F64, 64, 64, 64, 64, True, False, False), MATH, "torch.float64"),
    (("cuda", BF16, 64, 64, 64, 64, False, True, False), CUDA_EFFICIENT, ""),  # masked
    (("cuda", F32, 64, 64, 64, 64, False, True, False), CUDA_EFFICIENT, ""),
    (("cuda", BF16, 192, 128, 64, 48, False, True, False), CUDA_EFFICIENT, ""),  # masked MLA
    (("cuda", F64, 64, 64, 64, 64, False, True, False), MATH, "torch.float64"),
    (("cuda", BF16, 12, 12, 64, 64, False, True, False), MATH, "not multiples of 8"),
    (("cuda", F32, 64, 64, 64, 64, False, False, True), MATH, "post-scale bias"),
    (("cuda", BF16, 64, 64, 32, 64, True, False, False), MATH, "causal block of 32 x 64"),
    (("cuda", BF16, 12, 12, 64, 64, False, False, False), MATH, "not multiples of 8"),
    (("cuda", F32, 6, 6, 64, 64, False, False, False), MATH, "not multiples of 4"),
    (("cuda", BF16, 64, 64, 0, 64, False, False, False), MATH, "empty block"),
    (("mps", F32, 64, 64, 64, 64, False, False, False), MATH, "device type 'mps'"),
]


@pytest.mark.parametrize(("shape", "kernel", "why"), RULES)
def test_dispatch_rule(shape, kernel, why):
    device, dtype, d, dv, sq, sk, causal, masked, biased = shape
    choice = choose_kernel(device, dtype, d, dv, sq, sk, causal=causal, masked=masked,
                           biased=biased)
    assert choice.kernel == kernel, choice
    assert (why in choice.reason) if why else choice.reason == "", choice


def kernels_of(fmt="bshd", dtype=F64, dv=8, window=None, bias=False, causal=True):
    """The (kernel, reason) counts of one single-process attention call, forward and
    backward run."""
    gen = torch.Generator().manual_seed(0)
    meta = {}
    if fmt == "thd":
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        _, pad = pad_thd(torch.zeros(12, 1), cu, 1)
        t = int(pad[-1])
        shapes = [(t, 4, 8), (t, 2, 8), (t, 2, dv)]
        meta = dict(cu_seqlens_q=cu, cu_seqlens_q_padded=pad)
    else:
        shapes = [(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, dv)]
    q, k, v = (torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes)
    attn_bias = torch.zeros(1, 1, 16, 16, dtype=dtype) if bias else None
    with BlockCounter() as counter:
        out = local_attention(q, k, v, causal=causal, qkv_format=fmt, window_size=window,
                              attention_bias=attn_bias, **meta)
    out.sum().backward()
    return counter.kernels


def test_blocks_take_the_kernel_their_shape_gets():
    assert kernels_of() == {(CPU_FLASH, ""): 1}
    assert kernels_of(dtype=F32, causal=False) == {(CPU_FLASH, ""): 1}
    assert kernels_of(fmt="thd") == {(CPU_FLASH, ""): 1}  # the mask goes to the kernel
    assert kernels_of(window=(3, 0)) == {(CPU_FLASH, ""): 1}
    [(kernel, why)] = kernels_of(fmt="thd", dv=4)
    assert kernel == MATH and "MLA head dims" in why
    [(kernel, why)] = kernels_of(dv=4)
    assert kernel == MATH and "MLA head dims" in why
    assert kernels_of(bias=True) == {(MATH, "post-scale bias"): 1}


@pytest.mark.parametrize(("dtype", "causal"), itertools.product([F64, F32], [True, False]))
def test_cpu_flash_and_math_blocks_agree(dtype, causal):
    """The same block through both kernels: output, LSE and gradients."""
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, 4, 16, 8, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=dtype) for _ in range(2))
    tol = 1e-10 if dtype == F64 else 1e-5
    res = {}
    for kernel in (KernelChoice(CPU_FLASH), KernelChoice(MATH, "forced")):
        out, lse = block_forward(q, k, v, scale=0.3, causal=causal, kernel=kernel)
        grads = block_backward(dout, q, k, v, out, lse, scale=0.3, causal=causal,
                               kernel=kernel)
        res[kernel.kernel] = (out, lse, *grads)
    for a, b in zip(res[CPU_FLASH], res[MATH]):
        assert (a.to(b.dtype) - b).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [F64, F32])
def test_masked_blocks_agree_on_the_fused_and_math_kernels(dtype):
    """A masked block (thd, window) through the CPU flash kernel with an additive mask and
    through the math path: output, LSE and gradients. A row the mask hides entirely gets out
    0 and LSE -inf (the kernel itself says LSE 0), and no gradient when the final LSE of a row
    is -inf (no key anywhere) - also through the fused backward."""
    gen = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 4, 10, 8, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 7, 8, generator=gen, dtype=dtype) for _ in range(2))
    mask = torch.rand(10, 7, generator=gen) > 0.4
    mask[3] = False  # padding: no key for this row
    mask[6, 1:] = False
    mask[6, 0] = True
    res = {}
    for kernel in (KernelChoice(CPU_FLASH), KernelChoice(MATH, "forced")):
        out, lse = block_forward(q, k, v, scale=0.3, mask=mask, kernel=kernel)
        grads = block_backward(dout, q, k, v, out, lse, scale=0.3, mask=mask, kernel=kernel)
        res[kernel.kernel] = (out, lse, *grads)
    fused, math = res[CPU_FLASH], res[MATH]
    assert torch.equal(fused[0][:, :, 3], torch.zeros_like(fused[0][:, :, 3]))
    assert bool((fused[1][:, :, 3] == float("-inf")).all())
    assert bool(fused[2][:, :, 3].eq(0).all())  # dq of the hidden row
    for a, b in zip(fused, math):
        assert not a.isnan().any()
        torch.testing.assert_close(a.to(b.dtype), b, rtol=0, atol=TOL[dtype])
    # a block whose rows all saw keys elsewhere: the final LSE is finite where this block
    # hides a row; its gradient there is exactly 0 through both kernels
    final_lse = math[1].clone()
    final_lse[:, :, 3] = 1.5
    grads = [block_backward(dout, q, k, v, math[0], final_lse, scale=0.3, mask=mask,
                            kernel=kernel) for kernel in (KernelChoice(CPU_FLASH),
                                                          KernelChoice(MATH, "forced"))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=0, atol=TOL[dtype])
    assert bool(grads[0][0][:, :, 3].eq(0).all())


def test_a_mask_with_a_causal_block_hides_what_both_hide():
    """block_forward with a mask and causal=True (the planner never builds one; the function
    is public): a row the mask leaves visible only above the diagonal sees no key - LSE -inf
    and out 0 through the fused kernel as through the math path."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 6, 8, generator=gen, dtype=F64) for _ in range(4))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2, :3] = False  # row 2 keeps keys 3.. only: causal hides those
    res = []
    for kernel in (KernelChoice(CPU_FLASH), KernelChoice(MATH, "forced")):
        out, lse = block_forward(q, k, v, scale=0.3, causal=True, mask=mask, kernel=kernel)
        res.append((out, lse, *block_backward(dout, q, k, v, out, lse, scale=0.3,
                                              causal=True, mask=mask, kernel=kernel)))
    assert bool((res[0][1][:, :, 2] == float("-inf")).all())
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL[F64])


def test_a_nan_lse_is_not_hidden_by_the_masked_fused_backward():
    """The fused backward turns a hidden row's LSE -inf into +inf; a NaN (a bug upstream)
    stays NaN and shows in the gradients, as on the math path."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 2, 4, 8, generator=gen, dtype=F64) for _ in range(4))
    lse = torch.zeros(1, 2, 4, dtype=F64)
    lse[0, 0, 1] = float("nan")
    for kernel in (KernelChoice(CPU_FLASH), KernelChoice(MATH, "forced")):
        dq, *_ = block_backward(dout, q, k, v, q, lse, scale=0.3,
                                mask=torch.ones(4, 4, dtype=torch.bool), kernel=kernel)
        assert bool(dq[0, 0, 1].isnan().any()), kernel


def test_an_empty_packing_runs_without_a_fused_kernel():
    """Packed sequences of length 0 give empty blocks: they take the math path (torch's CPU
    flash kernel kills the process on them) and give an empty output and gradients."""
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    q, k, v = (torch.zeros(0, 2, 8, dtype=F64, requires_grad=True) for _ in range(3))
    with BlockCounter() as counter:
        out = local_attention(q, k, v, causal=True, qkv_format="thd", cu_seqlens_q=cu,
                              cu_seqlens_q_padded=cu)
    out.sum().backward()
    assert out.shape == (0, 2, 8) and q.grad.shape == q.shape
    assert {kernel for kernel, _why in counter.kernels} <= {MATH}


def test_torch_refuses_its_cuda_kernels_for_cpu_tensors():
    """The confirmation step of kernel_for builds torch's SDPA parameters on this torch."""
    q = torch.randn(1, 2, 8, 8)
    assert not torch_accepts(CUDA_FLASH, q, q, q, True)
    assert not torch_accepts(CUDA_EFFICIENT, q, q, q, False)


def test_torch_is_asked_about_grouped_kv_as_such(monkeypatch):
    """kernel_for asks torch about flash with K/V as they are (GQA: ``enable_gqa``) and about
    the efficient kernel with them expanded to q's heads (a stand-in, nothing copied); on CPU
    tensors torch refuses both either way."""
    from megatron_hcp.attention.reference import kernels

    q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    assert not torch_accepts(CUDA_FLASH, q, kv, kv, True)
    assert not torch_accepts(CUDA_EFFICIENT, q, kv.repeat_interleave(2, 1), kv, False)
    asked = []

    def accepts(kernel, q, k, v, causal, mask=None):
        asked.append((kernel, k.shape[1], v.shape[1], k.data_ptr() == kv.data_ptr()))
        return kernel == CUDA_EFFICIENT  # flash refused: the efficient kernel is asked next

    monkeypatch.setattr(kernels, "_torch_accepts", accepts)
    monkeypatch.setattr(kernels, "choose_kernel", lambda *a, **k: KernelChoice(CUDA_FLASH))
    choice = kernels.kernel_for(q, kv, kv, causal=True, mask=None, bias=None)
    assert choice.kernel == CUDA_EFFICIENT
    assert asked == [(CUDA_FLASH, 2, 2, True), (CUDA_EFFICIENT, 4, 4, True)], asked


def test_the_cpu_probe_asks_torchs_dispatcher_first(monkeypatch):
    """Where torch's SDPA dispatcher does not give GQA's K/V to the CPU flash kernel (releases
    before that kernel computed GQA: it would read K/V at the query heads' index, past their
    end), K/V are expanded and the probe never calls the kernel with them; MHA blocks never
    ask."""
    from torch.nn.attention import SDPBackend

    from megatron_hcp.attention.reference import kernels

    kernels.cpu_flash_takes_grouped_kv.cache_clear()
    try:
        monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: int(SDPBackend.MATH))
        assert not kernels.cpu_flash_takes_grouped_kv()
        q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
        out, lse = block_forward(q, kv, kv, scale=0.3, causal=True,
                                 kernel=KernelChoice(CPU_FLASH))
        assert out.shape == q.shape
    finally:
        kernels.cpu_flash_takes_grouped_kv.cache_clear()

    def asked(kernel):
        raise AssertionError("an MHA block asked whether its kernel takes grouped K/V")

    monkeypatch.setattr(kernels, "takes_grouped_kv", asked)
    out, lse = block_forward(q, q, q, scale=0.3, causal=True)
    block_backward(q, q, q, q, out, lse, scale=0.3, causal=True)


@pytest.mark.parametrize(("dtype", "masked"),
                         itertools.product([F64, F32, BF16, F16], [False, True]))
def test_grouped_kv_reach_the_cpu_flash_kernel_unexpanded(monkeypatch, dtype, masked):
    """GQA blocks (8 query heads, 2 KV heads) give the CPU flash kernel K/V as they are: they
    launch the ops of the same block with 8 KV heads (no copy of K/V expanded to the query
    heads forward, none and no sum over the groups backward; in half precision the backward
    runs in fp32, its five inputs converted, so that the groups' shares of dK/dV add up in
    fp32); output, LSE and gradients equal those of the same block on expanded K/V (the path
    of kernels that need it), causal or masked."""
    assert cpu_flash_takes_grouped_kv()  # this torch's CPU flash kernel computes GQA itself
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 8, 24, 16, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 24, 16, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(24, 24, generator=gen) > 0.4 if masked else None
    kwargs = dict(scale=0.25, causal=not masked, mask=mask, kernel=KernelChoice(CPU_FLASH))

    def block(k, v):
        out, lse = block_forward(q, k, v, **kwargs)
        return out, lse, *block_backward(dout, q, k, v, out, lse, **kwargs)

    grouped, launched = count_launches(block, k, v)
    _, mha = count_launches(block, torch.randn_like(q), torch.randn_like(q))
    to_fp32 = {"aten::_to_copy": 5} if dtype in (BF16, F16) else {}  # q, k, v, dout, out
    assert "aten::_to_copy" not in mha.by_op and launched.by_op == {**mha.by_op, **to_fp32}
    monkeypatch.setattr("megatron_hcp.attention.reference.kernels.cpu_flash_takes_grouped_kv",
                        lambda: False)
    expanded, launched = count_launches(block, k, v)
    assert launched.by_op.get("aten::sum", 0) == 2, launched.by_op  # dK, dV over the groups
    tol = {F64: 1e-12, F32: 1e-5, BF16: 2e-2, F16: 5e-3}[dtype]
    for got, want in zip(grouped, expanded):
        assert got.shape == want.shape
        torch.testing.assert_close(got.to(F64), want.to(F64), rtol=tol, atol=tol)


# Transformer Engine's tolerances for its CP attention tests in half precision (atol = rtol):
# bf16 GQA and fp16
TE_GQA_TOL = {BF16: 3.5e-2, F16: 5e-3}


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"),
                         [(BF16, 32, 4, 128), (BF16, 16, 2, 64), (F16, 16, 2, 64)])
def test_half_precision_gqa_gradients_are_within_tes_tolerance(dtype, heads, kv_heads,
                                                               head_dim):
    """A causal GQA attention in bf16 / fp16 (local_attention, one sequence of 256) against
    the fp64 attention of the same inputs, at Transformer Engine's tolerance: dK/dV sum each
    group's query heads, so their shares are summed in fp32 (summed in the inputs' dtype by
    the CPU flash kernel before 1bc6a63, dV was 1.1-1.9x over it in each of these cases:
    2026-11-29, a 2-core x86_64 CPU VM)."""
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 256, heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 256, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))

    def attention(fn, as_dtype):
        leaves = [x.detach().to(as_dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, causal=True, qkv_format="bshd")
        out.backward(dout.to(as_dtype))
        return out, *(x.grad for x in leaves)

    tol = TE_GQA_TOL[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), attention(local_attention, dtype),
                               attention(full_attention, F64)):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.to(F64), want, rtol=tol, atol=tol,
                                   msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.parametrize("window", [None, (5, 0), (2, 3)])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_block_replay_does_the_work_of_cp_attention(cp, window):
    """The speed benchmark's replay (every rank's blocks, no communication; with a window its
    masked blocks, some skipped) computes the oracle's output and gradients: what it times is
    the whole attention, once; its baseline's band mask is the oracle's."""
    from megatron_hcp.attention.reference.block_cost import band_mask

    gen = torch.Generator().manual_seed(cp)
    q, dout = (torch.randn(2, 4, 16, 8, generator=gen, dtype=F64) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=F64) for _ in range(2))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = full_attention(*(x.transpose(1, 2) for x in ref_in), causal=True, qkv_format="bshd",
                         window_size=window).transpose(1, 2)
    ref.backward(dout)
    band = band_mask(16, True, window, torch.device("cpu"))
    one = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band,
                                                           enable_gqa=True)
    torch.testing.assert_close(one, ref.detach(), rtol=0, atol=1e-12)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        out, dq, *rest = rank_block_pass(q, k, v, dout, cp, rank, window=window)
        outs.append(out)
        dqs.append(dq)
        c = k.shape[2] // (2 * cp)
        for src in range(cp):  # each source's K/V gradient, back to its global positions
            gk, gv = rest[src], rest[cp + src]
            for half, chunk in enumerate((src, 2 * cp - 1 - src)):
                dk[:, :, chunk * c:(chunk + 1) * c] += gk[:, :, half * c:(half + 1) * c]
                dv[:, :, chunk * c:(chunk + 1) * c] += gv[:, :, half * c:(half + 1) * c]

    def assemble(parts):
        c = q.shape[2] // (2 * cp)
        full = torch.zeros_like(q)
        for rank, part in enumerate(parts):
            full[:, :, rank * c:(rank + 1) * c] = part[:, :, :c]
            full[:, :, (2 * cp - 1 - rank) * c:(2 * cp - rank) * c] = part[:, :, c:]
        return full

    for got, want in ((assemble(outs), ref), (assemble(dqs), ref_in[0].grad),
                      (dk, ref_in[1].grad), (dv, ref_in[2].grad)):
        assert (got - want).abs().max().item() <= 1e-10


def test_block_cost_reports_kernels_and_times():
    cost = measure_block_cost(seq=64, heads=4, kv_heads=2, dim=8, cp=4, dtype=F32,
                              device="cpu", repeats=1)
    assert cost.kernels == {(CPU_FLASH, ""): 16} and cost.blocks_per_rank == 4
    assert cost.blocks_s > 0 and cost.sdpa_s > 0 and cost.ratio == cost.blocks_s / cost.sdpa_s
    mla = measure_block_cost(seq=64, heads=4, kv_heads=4, dim=12, dim_v=8, cp=2, dtype=F32,
                             device="cpu", repeats=1)  # MLA head dims: the CPU's math path
    assert set(mla.kernels) == {(MATH, "MLA head dims (d_qk 12, d_v 8): the CPU flash kernel "
                                       "needs one head dim")} and mla.blocks_per_rank == 2
    with pytest.raises(ValueError, match="multiple of 2\\*cp=8"):
        measure_block_cost(seq=60, heads=4, kv_heads=2, dim=8, cp=4, dtype=F32, device="cpu")


def test_the_oracle_follows_its_inputs_device():
    """full_attention builds its masks on q's device (CUDA in tests/gpu); the meta device shows
    it without a GPU (a CPU-built mask is refused there)."""
    q = torch.empty(2, 16, 4, 8, device="meta")
    k = torch.empty(2, 16, 2, 8, device="meta")
    for kwargs in ({}, {"window_size": (3, 0)}, {"causal": False}):
        out = full_attention(q, k, k, qkv_format="bshd", **kwargs)
        assert out.device.type == "meta" and out.shape == q.shape


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("by_index", [False, True])
def test_merging_blocks_in_any_order_is_attention_on_their_union(dtype, by_index):
    """merge_into (the first block copied in, later ones lerped by their LSE share) gives the
    attention of the queries on every block's keys together, in any order; rows no block has
    reached stay 0 with LSE -inf (no NaN), also when a later block does not reach them."""
    from megatron_hcp.attention.reference.merge import merge_into

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=dtype) for n in (6, 12, 12))
    mask = torch.ones(6, 12, dtype=torch.bool)
    mask[5] = False  # a query row no key reaches
    mask[4, :8] = False  # reached by the last block only
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    rows = torch.arange(6) if by_index else slice(None)
    for order in itertools.permutations(range(3)):
        out = torch.zeros(1, 2, 6, 8, dtype=dtype)
        lse = torch.full((1, 2, 6), float("-inf"), dtype=dtype)
        for step, part in enumerate(order):
            cols = slice(4 * part, 4 * part + 4)
            ob, lb = block_forward(q, k[:, :, cols], v[:, :, cols], scale=8 ** -0.5,
                                   mask=mask[:, cols])
            merge_into(out, lse, rows, ob, lb, first=step == 0)
        assert not out.isnan().any()
        torch.testing.assert_close(out, want, rtol=0, atol=TOL[dtype])
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=TOL[dtype])


def test_gpu_figure_table_runs_every_problem_and_cp_size():
    """benchmarks/attention.py --device cuda's table, run small on the CPU: a row per problem
    (MHA, GQA, MLA head dims), sequence length and CP size that cuts it, with the verdict
    against issue #34's goal (1.10x at CP <= 8, 1.25x at CP 16)."""
    from benchmarks.attention import goal, gpu_block_table

    problems = {"mha": (4, 4, 8, 8), "gqa": (4, 2, 8, 8), "mla": (4, 4, 12, 8),
                "window": (4, 4, 8, 8, 5)}
    lines = list(gpu_block_table([64, 48], problems, "fp32", [2, 4, 16], 1, device="cpu"))
    rows = lines[3:]
    assert len(rows) == 4 * 5 and lines[0].startswith("CPU, torch"), lines  # 48: no CP16
    assert [r.split()[0] for r in rows] == ["mha"] * 5 + ["gqa"] * 5 + ["mla"] * 5 + [
        "window"] * 5
    assert "w5" in rows[-1] and "cpu_flash" in rows[-1]  # masked blocks, the fused kernel
    assert [r.split()[3:5] for r in rows[:5]] == [["64", "2"], ["64", "4"], ["64", "16"],
                                                  ["48", "2"], ["48", "4"]]
    assert all(r.split()[11] in ("met", "missed") for r in rows), rows
    assert "math (MLA head dims" in rows[14] and "cpu_flash" in rows[0]
    # both merges timed against one call's time; on the CPU auto merges eagerly: 2 blocks at
    # CP2 -> one merge a rank, 2 ranks; the one call: SDPA (no FA2 on the CPU)
    assert lines[1].split()[4:10] == ["ms", "off", "ms", "auto", "1", "call"], lines[1]
    assert rows[0].endswith("; merges eager 2; baseline sdpa"), rows[0]
    assert rows[2].endswith("; merges eager 240; baseline sdpa"), rows[2]
    assert "; merges eager" in rows[-1] and "; masks eager" in rows[-1], rows[-1]
    assert (goal(8), goal(16)) == (1.10, 1.25)


def test_the_efficient_backward_gets_the_output_with_heads_inside_rows():
    """The efficient kernel's fp16/bf16 backward reads the output with a row stride of H*Dv of
    its own: an output in [B,H,S,Dv] memory order is re-laid (same values), one already in
    [B,S,H,Dv] order - as the CP accumulators are, also a half of its rows - passes as is."""
    from megatron_hcp.attention.reference.functions import _new_acc
    from megatron_hcp.attention.reference.kernels import _heads_inner

    bhsd = torch.randn(2, 4, 6, 8)
    fixed = _heads_inner(bhsd)
    assert torch.equal(fixed, bhsd) and fixed.stride(2) == 4 * 8
    out, _ = _new_acc(torch.zeros(2, 4, 6, 16), torch.zeros(2, 4, 6, 8), None)
    assert _heads_inner(out) is out and _heads_inner(out[:, :, 3:]) is not None
    assert out[:, :, 3:].stride(2) == 4 * 8 and _heads_inner(out[:, :, 3:]).data_ptr() == (
        out[:, :, 3:].data_ptr())
    one_head = torch.randn(2, 1, 6, 8)
    assert _heads_inner(one_head) is one_head


def test_grouped_halves_are_the_same_tokens_as_slices():
    """Packed zigzag tokens with their halves grouped (the attention's own order): the same
    per-token metadata, permuted by half_grouping; each half a slice; the same order on every
    CP position, so travelling K/V keep it; every block sees the same (query, key) pairs."""
    from megatron_hcp.attention.reference.blocks import plan_block
    from megatron_hcp.attention.reference.seq_layout import SeqLayout, half_grouping

    padded, real, cp = (8, 16, 0, 24), (5, 16, 0, 20), 4  # chunks of 1, 2, 0 and 3 tokens
    order = half_grouping(padded, cp)
    assert order.tolist() == [0, 2, 3, 6, 7, 8, 1, 4, 5, 9, 10, 11]

    def pairs(block, to_token):
        rows, cols = (torch.arange(12)[s] if isinstance(s, slice) else s
                      for s in (block.rows, block.cols))
        mask = block.mask.dense() if block.mask is not None else torch.ones(
            len(rows), len(cols), dtype=torch.bool).tril(0 if block.causal else 12)
        return {(int(to_token[rows[i]]), int(to_token[cols[j]]))
                for i, j in mask.nonzero().tolist()}

    for position in range(cp):
        plain = SeqLayout(padded, real, cp, position)
        assert plain.groupable and not SeqLayout.dense(8, cp, position).groupable
        grouped = plain.with_grouped_halves()
        assert not grouped.groupable and grouped.at(cp, 1).grouped
        for a, b in ((grouped.seq_id, plain.seq_id), (grouped.pos, plain.pos),
                     (grouped.valid, plain.valid)):
            assert torch.equal(a, b[order])
        assert grouped.half("first") == slice(0, 6) and grouped.half("second") == slice(6, 12)
        for src in range(cp):
            for window in (None, (3, 0)):
                want = plan_block(plain, plain.at(cp, src), True, window)
                got = plan_block(grouped, grouped.at(cp, src), True, window)
                assert (want is None) == (got is None)
                if want is not None:  # the same pairs, named by their plain token index
                    assert pairs(got, order) == pairs(want, torch.arange(12)), (position, src)


def test_grouping_applies_once_and_only_where_it_moves_tokens():
    """with_grouped_halves refuses a layout it does not apply to (already grouped, dense,
    contiguous, CP 1), naming why; a packing whose tokens all sit in one sequence is its own
    grouping, so the attention does not reorder it."""
    from megatron_hcp.attention.reference.seq_layout import SeqLayout, half_grouping

    packed = SeqLayout((8, 16), (8, 12), 4, 1)
    for layout in (packed.with_grouped_halves(), SeqLayout.dense(8, 4, 1),
                   SeqLayout((8, 16), (8, 12), 4, 1, "contiguous"),
                   SeqLayout((8, 16), (8, 12), 1, 0)):
        with pytest.raises(ValueError, match="is not groupable; grouping applies once, to "
                                             "packed zigzag sequences at CP > 1"):
            layout.with_grouped_halves()
    for padded, real, moves in (((8, 16), (8, 12), True), ((0, 16, 0), (0, 12, 0), False),
                                ((16,), (12,), False)):
        layout = SeqLayout(padded, real, 4, 2)
        identity = torch.equal(half_grouping(padded, 4), torch.arange(layout.local_tokens))
        assert layout.grouping_moves_tokens == moves == (not identity), padded


@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp,a", [(4, 2), (8, 2), (8, 4), (4, 4)])
def test_a2a_permutation_gives_the_layout_one_level_up(mode, cp, a):
    """The a2a's gather permutation (api._a2a_permutations), alone and composed with the half
    grouping: the a ranks' tokens concatenated in a2a order and taken in its order are,
    token for token (sequence, position, real or padding), the layout of CP size cp/a at the
    group's position - with its halves grouped where the attention groups them - and the
    inverse takes them back."""
    from megatron_hcp.attention.reference.api import _a2a_permutations
    from megatron_hcp.attention.reference.seq_layout import SeqLayout

    padded, real = (2 * cp, 4 * cp, 0, 6 * cp), (2 * cp - 1, 4 * cp, 0, 5 * cp)
    p = cp // a
    for group in range(p):
        ranks = [SeqLayout(padded, real, cp, group * a + i, mode) for i in range(a)]
        gathered = [torch.cat([getattr(r, f) for r in ranks]) for f in ("seq_id", "pos", "valid")]
        up = ranks[0].at(p, group)
        for grouped in ([False, True] if up.groupable else [False]):
            perm, inv = _a2a_permutations(ranks[0], a, grouped)
            want = up.with_grouped_halves() if grouped else up
            for got, field in zip(gathered, ("seq_id", "pos", "valid")):
                assert torch.equal(got[perm], getattr(want, field)), (group, grouped, field)
                assert torch.equal(got[perm][inv], got)


def test_huge_masked_blocks_run_in_row_chunks_where_torch_addresses_32_bits(monkeypatch):
    """torch < 2.13's efficient kernel addresses its mask rows with 32-bit offsets: a masked
    block of 2^31 mask elements or more (rows padded to 16) runs there in row chunks below
    that, which compute what the whole block computes - a packed block's mask and a boolean
    one, a causal flag folded into the mask first (CPU flash kernel, a small limit)."""
    from megatron_hcp.attention.reference import kernels
    from megatron_hcp.attention.reference.blocks import plan_block
    from megatron_hcp.attention.reference.pieces import splitting
    from megatron_hcp.attention.reference.seq_layout import SeqLayout

    monkeypatch.setattr(kernels, "_BIAS_ELEMENTS", 32 * 20)  # 20 rows of 32 (cols 17..32)
    assert kernels._row_chunks(19, 20) is None
    assert kernels._row_chunks(50, 20) == [slice(0, 20), slice(20, 40), slice(40, 50)]
    mask = torch.ones(50, 20, dtype=torch.bool)
    assert len(kernels._chunks_for(CUDA_EFFICIENT, 50, mask)) == 3  # only that kernel, masked
    assert kernels._chunks_for(CUDA_FLASH, 50, mask) is None
    assert kernels._chunks_for(CPU_FLASH, 50, mask) is None
    assert kernels._chunks_for(CUDA_EFFICIENT, 50, None) is None
    monkeypatch.setattr(kernels, "_BIAS_ELEMENTS", None)  # torch >= 2.13: whole
    assert kernels._row_chunks(10**6, 10**6) is None
    monkeypatch.setattr(kernels, "_BIAS_ELEMENTS", 32 * 7)
    layout = SeqLayout((16, 32), (13, 30), 1, 0)  # 48 tokens, two packed sequences
    with splitting("off"):
        block = plan_block(layout, layout, True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 8, generator=gen, dtype=torch.float64) for _ in "qkv")
    boolean = torch.rand(48, 48, generator=gen) < 0.5
    for mask, causal in ((block.mask, False), (boolean, True), (boolean, False)):
        chunks = kernels._row_chunks(48, 32)
        assert len(chunks) == 7
        got = kernels._in_row_chunks(
            lambda rows, part: kernels._fused_forward(CPU_FLASH, rows, k, v, 0.3, False, part),
            q, mask, causal, chunks)
        want = kernels._fused_forward(CPU_FLASH, q, k, v, 0.3, causal, mask)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_torch_is_asked_as_for_training_with_an_unallocated_mask(monkeypatch):
    """torch's kernel checks are asked as its SDPA front end asks them for a training call -
    grad mode on, q requiring grad (it refuses flash for some head dims on some GPUs only
    then) - even from the autograd Function's forward (grad mode off); an inference tensor
    as it is. A mask is asked as one row expanded (stride 0): no [rows, cols] allocation."""
    from torch.backends import cuda as sdp

    seen = []

    def check(params, debug):
        seen.append((torch.is_grad_enabled(), params.query.requires_grad,
                     None if params.attn_mask is None else params.attn_mask.stride()))
        return True

    monkeypatch.setattr(sdp, "can_use_efficient_attention", check)
    q = torch.randn(1, 2, 64, 8)
    with torch.no_grad():
        assert torch_accepts(CUDA_EFFICIENT, q, q, q, False,
                              torch.ones(64, 48, dtype=torch.bool))
    with torch.inference_mode():
        frozen = torch.randn(1, 2, 64, 8)
        assert torch_accepts(CUDA_EFFICIENT, frozen, frozen, frozen, True)
    assert seen == [(True, True, (0, 1)), (True, False, None)], seen
    assert not q.requires_grad
