"""Blockwise attention kernels with log-sum-exp (LSE).

A *block* is one piece of a CP attention: some local query tokens against some key/value tokens.
Its forward returns the block output and LSE; partial results merge exactly through
:func:`~.merge.merge_into`. Its backward takes the *final* (merged) output and LSE, so the
block's gradients are exact contributions to the full gradients.

Which kernel a block takes (:func:`choose_kernel`, from the block's shape alone; recorded per
forward block in :class:`~.block_counter.BlockCounter`):

* ``cpu_flash`` - PyTorch's blockwise CPU flash kernel
  (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward): CPU blocks without
  bias whose q, k and v share one head dim; a masked block (packed ``thd`` sequences, a sliding
  window) passes its mask as an additive ``attn_mask`` (0 / ``-inf``). GQA blocks give it K/V
  as they are; in half precision their backward runs in fp32 (:func:`backward_dtype`: the
  kernel sums a group's dK/dV in its inputs' dtype).
* ``cuda_flash`` - FlashAttention-2 through ``aten::_scaled_dot_product_flash_attention`` (and
  ``..._backward``): CUDA, fp16/bf16, no mask, one head dim, a multiple of 8 and <= 256.
* ``cuda_efficient`` - the memory-efficient kernel through
  ``aten::_scaled_dot_product_efficient_attention`` (and ``..._backward``): CUDA fp32 blocks,
  masked blocks (the mask as an additive ``attn_bias``, its rows 16-element aligned, as torch's
  SDPA front end lays it out), and fp16/bf16 blocks flash does not take (MLA's
  ``d_v != d_qk``, head dims > 256); head dims must be multiples of 16 bytes.
* ``math`` - explicit matmul + softmax in the accumulation dtype, for every other block, with
  the reason: a post-scale bias (its gradient is needed), fp64 on CUDA (the fused CUDA kernels
  have no fp64), MLA head dims on CPU (the CPU flash kernel needs one head dim), head dims the
  CUDA kernels cannot align, a causal block that is not square (never planned; the kernels
  align such masks differently), and CUDA blocks torch itself refuses on this GPU
  (``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention``).

Both CUDA kernels return the LSE of their rows in fp32 (the efficient kernel pads it to a
multiple of 32 rows with ``+inf``; its backward reads the padding, so it gets it back), as
torch's own context-parallel attention uses them. Causal blocks are top-left aligned and
square, where every kernel agrees. Rows with no visible key (padding, a mask row of ``-inf``)
give output 0 and LSE ``-inf`` whatever the kernel (the fused ones write LSE 0 for such a row;
it is overwritten), and no gradient: their LSE goes to a fused backward as ``+inf``, which makes
every probability of the row 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.torch_version import TorchVersion

from .block_counter import record_kernel
from .kernel_support import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, MATH, acc_dtype
from .kernel_support import torch_accepts as _torch_accepts
from .masks import BlockMask, additive_of

__all__ = ["KernelChoice", "block_backward", "block_forward", "choose_kernel", "expand_kv",
           "kernel_for", "reduce_kv", "row_chunks"]

_NEG_INF = float("-inf")
_HALF = (torch.float16, torch.bfloat16)
_LSE_ALIGN = 32  # rows of the efficient kernel's LSE (padded with +inf)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel one block takes and, for ``math``, why no fused kernel takes it."""

    kernel: str
    reason: str = ""


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                  q_len: int, kv_len: int, *, causal: bool, masked: bool, biased: bool
                  ) -> KernelChoice:
    """The kernel of a block from its shape alone (the rules of the module docstring)."""
    if biased:
        return KernelChoice(MATH, "post-scale bias")
    if q_len == 0 or kv_len == 0:  # torch's CPU flash kernel dies (SIGFPE) on an empty block
        return KernelChoice(MATH, "empty block")
    if device_type == "cpu":
        if head_dim != head_dim_v:
            return KernelChoice(MATH, f"MLA head dims (d_qk {head_dim}, d_v {head_dim_v}): "
                                      "the CPU flash kernel needs one head dim")
        return KernelChoice(CPU_FLASH)
    if device_type != "cuda":
        return KernelChoice(MATH, f"no fused kernel on device type {device_type!r}")
    if dtype not in (*_HALF, torch.float32):
        return KernelChoice(MATH, f"{dtype}: the CUDA flash / efficient kernels take fp16, "
                                  "bf16 and fp32")
    if causal and q_len != kv_len:
        return KernelChoice(MATH, f"causal block of {q_len} x {kv_len}: the kernels align a "
                                  "non-square causal mask differently")
    if (dtype in _HALF and not masked and head_dim == head_dim_v and head_dim % 8 == 0
            and head_dim <= 256):
        return KernelChoice(CUDA_FLASH)
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if head_dim % align == 0 and head_dim_v % align == 0:
        return KernelChoice(CUDA_EFFICIENT)
    return KernelChoice(MATH, f"head dims {head_dim} / {head_dim_v} are not multiples of "
                              f"{align} ({dtype}): the CUDA kernels need 16-byte rows")


@lru_cache(maxsize=1)
def cpu_flash_takes_grouped_kv() -> bool:
    """Whether this torch's CPU flash kernel computes grouped-query attention itself (K/V with
    fewer heads than q, forward and backward, dK/dV summed over each group). Asked first of
    torch's SDPA dispatcher, which picks that kernel for such K/V (``enable_gqa``) only where
    it does - older releases pick the math path, and their kernel, never given such K/V, would
    read them at the query heads' index - then checked once against the same block on K/V
    expanded to q's heads."""
    from torch.nn.attention import SDPBackend

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 4, 8, generator=gen) for h in (2, 1, 1, 2))
    try:
        choice = torch._fused_sdp_choice(q, k, v, enable_gqa=True)
    except (AttributeError, TypeError, RuntimeError):  # no such dispatcher question here
        return False
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return False
    add = torch.zeros(4, 4).masked_fill_(torch.ones(4, 4, dtype=torch.bool).triu(1), _NEG_INF)
    ke, ve = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = flash(q, k, v, 0.0, False, attn_mask=add, scale=0.5)
    dq, dk, dv = back(dout, q, k, v, out, lse, 0.0, False, attn_mask=add, scale=0.5)
    want_out, want_lse = flash(q, ke, ve, 0.0, False, attn_mask=add, scale=0.5)
    want = back(dout, q, ke, ve, want_out, want_lse, 0.0, False, attn_mask=add, scale=0.5)
    got = (out, lse, dq, dk, dv)
    expect = (want_out, want_lse, want[0], reduce_kv(want[1], 1), reduce_kv(want[2], 1))
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
               for a, b in zip(got, expect))


def takes_grouped_kv(kernel: str) -> bool:
    """Whether ``kernel`` takes K/V with fewer heads than q as they are: the flash kernels
    (FlashAttention-2 on CUDA, where :func:`kernel_for` asked torch with ``enable_gqa``; the
    CPU one where :func:`cpu_flash_takes_grouped_kv`). The others take K/V expanded to q's
    heads, their gradients summed back over each group."""
    return kernel == CUDA_FLASH or (kernel == CPU_FLASH and cpu_flash_takes_grouped_kv())


def backward_dtype(kernel: str, dtype: torch.dtype, grouped_kv: bool) -> torch.dtype:
    """The dtype the fused ``kernel`` runs a ``dtype`` block's backward in (``grouped_kv``: K/V
    with fewer heads than q, as :func:`takes_grouped_kv` gives them): the block's own, but
    fp32 for a half-precision block with grouped K/V on the CPU flash kernel. That kernel adds
    every query block's and every query head's share of dK/dV into its gradient in place, in
    its inputs' dtype (a GEMM with beta 1 each), so in bf16 a group's shares were rounded to
    bf16 at every addition (dV of 8 heads per group up to 2x over Transformer Engine's bf16
    GQA tolerance against fp64, at 256 tokens). In fp32 they add up in fp32, as in
    FlashAttention-2 and Transformer Engine's kernels (each head's dK/dV accumulated in fp32,
    a group's heads summed with fp32 accumulation); K/V stay unexpanded. The cost: the
    inputs converted (q, dout, out, k, v: 4 bytes an element) and 4-byte gradients, for the
    block's backward only (``benchmarks/gqa_backward.py``)."""
    if grouped_kv and kernel == CPU_FLASH and dtype in _HALF:
        return torch.float32
    return dtype


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
               mask: torch.Tensor | BlockMask | None, bias: torch.Tensor | None
               ) -> KernelChoice:
    """The kernel of the block ``q`` [B,H,Sq,D] x ``k``/``v`` [B,Hkv,Sk,D] (Hkv divides H):
    the shape rule, confirmed on CUDA by torch's own checks (falling back flash -> efficient ->
    math; flash is asked with K/V as they are, the efficient kernel with them expanded to q's
    heads, as it will get them)."""
    choice = choose_kernel(q.device.type, q.dtype, q.shape[-1], v.shape[-1], q.shape[2],
                           k.shape[2], causal=causal, masked=mask is not None,
                           biased=bias is not None)
    if choice.kernel == CUDA_FLASH and not _torch_accepts(CUDA_FLASH, q, k, v, causal):
        choice = KernelChoice(CUDA_EFFICIENT)
    if choice.kernel == CUDA_EFFICIENT and not _torch_accepts(
            CUDA_EFFICIENT, q, _expanded_view(k, q.shape[1]), _expanded_view(v, q.shape[1]),
            causal, mask):
        return KernelChoice(MATH, "torch refuses its flash and efficient kernels for this "
                                  "block on this GPU (torch.backends.cuda.can_use_*_attention)")
    return choice


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [B, Hkv, S, D] repeated to ``heads`` heads (each KV head for its query group)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _expanded_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A stand-in of ``x`` [B,Hkv,S,D] expanded to ``heads`` heads, copying nothing, for
    torch's kernel checks (they read shapes, dtypes and the last dim's stride, not values)."""
    if x.shape[1] == heads:
        return x
    return x[:, :1].expand(x.shape[0], heads, *x.shape[2:])


def reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of K/V expanded by :func:`expand_kv` summed back onto ``kv_heads``."""
    b, h, s, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _no_rng() -> torch.Tensor:
    """The philox seed / offset the fused kernels return without dropout (unused by their
    backward then): an empty CPU int64 scalar."""
    return torch.empty((), dtype=torch.int64)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fused kernels take it: any batch / head / sequence strides (a block's half
    of the rows is a strided view), the head dim contiguous; copied only where it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_inner(out: torch.Tensor) -> torch.Tensor:
    """``out`` [B,H,S,Dv] with its heads inside its rows in memory ([B,S,H,Dv] order), as the
    efficient kernel's backward reads it: in every dtype that kernel computes its row sums from
    ``out`` with a row stride of ``H*Dv`` of its own, whatever ``out``'s strides are (torch's
    ``kernel_backward.h``, ``o_strideM``), so an output in [B,H,S,Dv] order would give wrong
    gradients without an error. Copied only when needed (the accumulators are allocated in
    that order)."""
    if out.shape[1] == 1 or out.stride(2) == out.shape[1] * out.shape[3]:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _additive(mask: torch.Tensor | BlockMask, causal: bool, q: torch.Tensor, seen: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block mask as the fused kernels take it and which of its rows see any key (where
    ``seen`` is asked for): 0 where visible, ``-inf`` elsewhere, in q's dtype. A causal flag
    with a mask is folded into the mask (the kernel then runs without it), so that the rows
    the mask hides are exactly the rows that see no key. On CUDA its rows start 16-element
    aligned (a view of a padded buffer: the efficient kernel loads bias rows 128 bits at a
    time and checks only part of that, and torch's SDPA front end pads the mask the same way
    before calling it) and it is seen as [B, H, Sq, Sk] (the kernel takes a 4-D bias; the
    expansion copies nothing). A :class:`~.masks.BlockMask` builds it from its tokens'
    metadata (one fused kernel where :mod:`.gpu.fused` says so)."""
    if causal:  # never planned with a mask: the triangle folds into booleans
        mask = mask.dense() if isinstance(mask, BlockMask) else mask
        mask = mask & torch.ones_like(mask).tril()
    sq, sk = mask.shape
    width = -(-sk // 16) * 16 if q.device.type == "cuda" else sk
    if isinstance(mask, BlockMask):
        add, rows_seen = mask.additive(q.dtype, width, seen=seen)
    else:
        add, rows_seen = additive_of(mask, q.dtype, width, seen=seen)
    if q.device.type == "cuda":
        add = add.expand(q.shape[0], q.shape[1], sq, sk)
    return add, rows_seen


# torch before 2.13 addresses the efficient kernel's bias rows in its forward with a 32-bit
# offset (``query_start * bias_strideM``, mem_eff_attention/kernel_forward.h; 2.13 computes
# it in 64 bits): wrong rows past 2^32 mask elements, silently. Masked blocks that large run
# in row chunks of at most 2^31 elements there.
_BIAS_ELEMENTS = 2**31 if TorchVersion(torch.__version__) < "2.13" else None


def _row_chunks(rows: int, cols: int) -> list[slice] | None:
    """The row chunks a masked block of ``rows`` x ``cols`` runs in on the efficient kernel
    (its mask rows padded to 16 elements), or ``None`` where it runs whole."""
    width = -(-cols // 16) * 16
    if _BIAS_ELEMENTS is None or rows * width < _BIAS_ELEMENTS:
        return None
    step = max(1, _BIAS_ELEMENTS // width)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _chunks_for(kernel: str, rows: int, mask: torch.Tensor | BlockMask | None
                ) -> list[slice] | None:
    """The row chunks a block runs in on ``kernel`` (:func:`_row_chunks`: the efficient
    kernel's masked blocks only), or ``None``."""
    if kernel != CUDA_EFFICIENT or mask is None:
        return None
    return _row_chunks(rows, mask.shape[1])


# what a block builds of rows x cols - a masked block's additive mask and the booleans that
# build it, the math path's scores and probabilities - is held within 1/MASK_SHARE of the
# elements of the block's q, or MASK_ELEMENTS / CHUNK_ELEMENTS (small blocks run whole):
# :func:`row_chunks` cuts the rows where it would take more (a packed block of a few long
# sequences, a window block, the whole sequence after an a2a, MLA head dims on the CPU:
# rows x cols grows with the local sequence squared, q only with it)
MASK_SHARE = 8
# a mask's elements: 4 bytes (fp32 mask) + a few booleans each; 2^15, an eighth of q at 256
# tokens a rank with 16 heads of 64 (a2a+p2p's ring at CP 16, S 4096, 8 heads: 2^16 held
# a mask and a row chunk's dq beside two K/V messages at 2.01x of a flash call's peak;
# the launch proxy's masks are smaller)
MASK_ELEMENTS = 2**15
CHUNK_ELEMENTS = 2**18  # the math path's scores


def row_chunks(q: torch.Tensor, v: torch.Tensor, rows: int, cols: int, *, causal: bool,
               masked: bool, biased: bool) -> list[slice] | None:
    """The chunks of its query rows a block of ``rows`` x ``cols`` runs in (``q`` [B, H, *,
    D], ``v`` [B, Hkv, *, Dv]: the tensors it takes its rows and columns from), each a block
    of its own: where its kernel (:func:`choose_kernel`) builds something of rows x cols - a
    fused kernel's mask (rows 16-element aligned on CUDA), the math path's [B, H, rows, cols]
    scores - that would take more than :data:`MASK_SHARE` and the floors allow;
    ``None``: the block whole (an unmasked fused block builds nothing of that size; a biased
    one takes its [rows, cols] bias gradient anyway)."""
    kernel = choose_kernel(q.device.type, q.dtype, q.shape[-1], v.shape[-1], rows, cols,
                           causal=causal, masked=masked, biased=biased).kernel
    b, h, _, d = q.shape
    if kernel == MATH and not biased:
        per_row, floor = b * h * cols, CHUNK_ELEMENTS
    elif masked and kernel in (CPU_FLASH, CUDA_EFFICIENT):
        per_row = -(-cols // 16) * 16 if q.device.type == "cuda" else cols
        floor = MASK_ELEMENTS
    else:
        return None
    step = max(1, max(b * h * rows * d // MASK_SHARE, floor) // max(per_row, 1))
    if step >= rows:
        return None
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _mask_rows(mask: torch.Tensor | BlockMask, rows: slice, causal: bool
               ) -> torch.Tensor | BlockMask:
    """The mask of the query ``rows`` only, a causal flag folded in (its diagonal offset by
    the rows' start: a chunk's diagonal is not its own)."""
    part = mask.query_rows(rows) if isinstance(mask, BlockMask) else mask[rows]
    if not causal:
        return part
    part = part.dense() if isinstance(part, BlockMask) else part
    return part & torch.ones_like(part).tril(rows.start)


def _in_row_chunks(run, q, mask: torch.Tensor | BlockMask, causal: bool,
                   chunks: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run(q rows, their mask)`` per chunk of rows, outputs and LSEs concatenated (rows
    are independent)."""
    parts = [run(q[:, :, rows], _mask_rows(mask, rows, causal)) for rows in chunks]
    return torch.cat([out for out, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def _fused_forward(kernel: str, q, k, v, scale: float, causal: bool,
                   mask: torch.Tensor | BlockMask | None = None):
    if chunks := _chunks_for(kernel, q.shape[2], mask):
        return _in_row_chunks(
            lambda rows, part: _fused_forward(kernel, rows, k, v, scale, False, part),
            q, mask, causal, chunks)
    add = seen = None
    if mask is not None:  # the causal flag folds into the mask
        add, seen = _additive(mask, causal, q, seen=True)
        causal = False
    if kernel == CPU_FLASH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=add, scale=scale)
    elif kernel == CUDA_FLASH:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, add, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]  # drop the +inf padding rows
    if seen is not None:  # rows the mask hides entirely: both kernels write out 0 and LSE 0
        # (the CPU one checked by the tests; the efficient one since torch 2.5): LSE -inf
        lse.masked_fill_(~seen, _NEG_INF)
    return out, lse


def _fused_backward(kernel: str, dout, q, k, v, out, lse, scale: float, causal: bool,
                    mask: torch.Tensor | BlockMask | None = None):
    dout, out = _rows(dout), _rows(out)  # q, k, v: as block_backward made them
    add = None
    if mask is not None:  # rows that saw no key (LSE -inf) take LSE +inf: probabilities 0
        add, _ = _additive(mask, causal, q, seen=False)
        causal = False
        inf = float("inf")  # one op; a NaN stays NaN
        lse = torch.nan_to_num(lse, nan=float("nan"), posinf=inf, neginf=inf)
    if kernel == CPU_FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=add, scale=scale)
    lse = lse.to(torch.float32)
    if kernel == CUDA_FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
            causal, _no_rng(), _no_rng(), scale=scale)
    out = _heads_inner(out)
    b, h, sq = lse.shape
    padded = torch.full((b, h, -(-sq // _LSE_ALIGN) * _LSE_ALIGN), float("inf"),
                        dtype=torch.float32, device=lse.device)
    padded[..., :sq] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, add, out, padded, _no_rng(), _no_rng(), 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _math_scores(q, k, scale, causal, mask, bias=None):
    if isinstance(mask, BlockMask):
        mask = mask.dense()
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:  # post-scale bias, broadcast over [B, H, Sq, Sk]
        s = s + bias.to(s.dtype)
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        mask = keep if mask is None else mask & keep
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF)
    return s


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | BlockMask | None = None,
    bias: torch.Tensor | None = None,
    kernel: KernelChoice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B,H,Sq,D] on ``k`` [B,Hkv,Sk,D], ``v`` [B,Hkv,Sk,Dv]; (out, lse).

    ``causal`` is top-left aligned (query i sees keys <= i); ``mask`` [Sq, Sk] marks visible
    pairs (booleans, or a :class:`~.masks.BlockMask` that builds them); ``bias``
    (broadcastable to [B,H,Sq,Sk]) is added after scaling. ``kernel``: the block's
    :func:`kernel_for` (computed when not given; counted in every active
    :class:`~.block_counter.BlockCounter`). ``out`` has q's dtype (the fused kernels) or the
    accumulation dtype (math); ``lse`` is [B,H,Sq].
    """
    heads = q.shape[1]
    q, k, v = _rows(q), _rows(k), _rows(v)
    if kernel is None:
        kernel = kernel_for(q, k, v, causal=causal, mask=mask, bias=bias)
    record_kernel(kernel.kernel, kernel.reason)
    if k.shape[1] != heads and (kernel.kernel == MATH or not takes_grouped_kv(kernel.kernel)):
        k, v = expand_kv(k, heads), expand_kv(v, heads)
    if kernel.kernel != MATH:
        return _fused_forward(kernel.kernel, q, k, v, scale, causal, mask)
    acc = acc_dtype(q.dtype)
    s = _math_scores(q.to(acc), k.to(acc), scale, causal, mask, bias)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(p, v.to(acc)), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | BlockMask | None = None,
    bias: torch.Tensor | None = None,
    kernel: KernelChoice | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of one block given the final ``out``/``lse`` of its query rows.

    Returns (dq [B,H,Sq,D], dk [B,Hkv,Sk,D], dv [B,Hkv,Sk,Dv]) in the accumulation dtype
    (a fused kernel's in the dtype it ran in, :func:`backward_dtype`: adding them into the
    accumulation-dtype gradient converts them on the way, in the same kernel), and
    with ``bias`` also d bias [B,H,Sq,Sk] (before reducing to the bias's broadcast shape).
    ``kernel``: the block's :func:`kernel_for` (computed when not given).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    acc = acc_dtype(q.dtype)
    q, k, v = _rows(q), _rows(k), _rows(v)  # as the fused kernels take them
    dbias = None
    if kernel is None:
        kernel = kernel_for(q, k, v, causal=causal, mask=mask, bias=bias)
    grouped = kv_heads == heads or (kernel.kernel != MATH and takes_grouped_kv(kernel.kernel))
    ke, ve = (k, v) if grouped else (expand_kv(k, heads), expand_kv(v, heads))
    if kernel.kernel != MATH:
        run = backward_dtype(kernel.kernel, q.dtype, ke.shape[1] != heads)
        dq, dk, dv = _fused_backward(kernel.kernel, dout.to(run), q.to(run), ke.to(run),
                                     ve.to(run), out.to(run), lse, scale, causal, mask)
        if ke.shape[1] != kv_heads:  # expanded: the query heads' shares are summed in acc's
            dk, dv = dk.to(acc), dv.to(acc)  # precision (a grouped kernel sums them itself)
    else:
        qa, ka, va, doa = q.to(acc), ke.to(acc), ve.to(acc), dout.to(acc)
        s = _math_scores(qa, ka, scale, causal, mask, bias)
        # rows that saw no key anywhere (lse = -inf) get p = 0
        p = torch.exp(s - torch.where(torch.isinf(lse), float("inf"), lse).unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), doa)
        dp = torch.matmul(doa, va.transpose(-1, -2))
        delta = (doa * out.to(acc)).sum(-1, keepdim=True)
        dscores = p * (dp - delta)
        if bias is not None:
            dbias = dscores
        ds = dscores * scale
        dq = torch.matmul(ds, ka)
        dk = torch.matmul(ds.transpose(-1, -2), qa)
    grads = (dq, reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads))
    return grads if bias is None else (*grads, dbias)
