"""Blockwise attention kernels with log-sum-exp (LSE), and the LSE merge.

A *block* is one piece of a CP attention: some local query tokens against some key/value tokens.
Its forward returns the block output and LSE; partial results merge exactly through
:func:`merge_into`. Its backward takes the *final* (merged) output and LSE, so the block's
gradients are exact contributions to the full gradients.

Unmasked and causal blocks run PyTorch's blockwise CPU flash kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward); masked blocks (packed
``thd`` data) and devices without that kernel use an explicit math path. Rows with no visible key
(padding) give output 0 and LSE ``-inf``, and no gradient. ``v`` may have its own head dim
(MLA: ``Dv != D``); such blocks take the math path (the flash kernel needs one head dim).
"""

from __future__ import annotations

import torch

__all__ = ["acc_dtype", "block_backward", "block_forward", "merge_into"]

_NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _reduce_kv(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _use_flash(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The CPU flash kernel takes no mask and one head dim for q, k and v (not MLA shapes)."""
    return mask is None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _math_scores(q, k, scale, causal, mask, bias=None):
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
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B,H,Sq,D] on ``k`` [B,Hkv,Sk,D], ``v`` [B,Hkv,Sk,Dv]; (out, lse).

    ``causal`` is top-left aligned (query i sees keys <= i); ``mask`` [Sq, Sk] marks visible
    pairs; ``bias`` (broadcastable to [B,H,Sq,Sk]) is added after scaling. ``out`` has q's
    dtype (flash) or the accumulation dtype (math); ``lse`` is [B,H,Sq].
    """
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    if bias is None and _use_flash(q, v, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
        )
        return out, lse
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
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of one block given the final ``out``/``lse`` of its query rows.

    Returns (dq [B,H,Sq,D], dk [B,Hkv,Sk,D], dv [B,Hkv,Sk,Dv]) in the accumulation dtype, and
    with ``bias`` also d bias [B,H,Sq,Sk] (before reducing to the bias's broadcast shape).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    acc = acc_dtype(q.dtype)
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    dbias = None
    if bias is None and _use_flash(q, v, mask):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).contiguous(),
            q.contiguous(),
            ke.contiguous(),
            ve.contiguous(),
            out.to(q.dtype).contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)
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
    grads = (dq, _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads))
    return grads if bias is None else (*grads, dbias)


def merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    rows: slice | torch.Tensor,
    out_blk: torch.Tensor,
    lse_blk: torch.Tensor,
) -> None:
    """Merge a block result into the running (out, lse) at query ``rows`` (in place).

    ``out_acc`` [B,H,S,D] and ``lse_acc`` [B,H,S] are in the accumulation dtype.
    """
    if isinstance(rows, slice):
        o, m = out_acc[:, :, rows], lse_acc[:, :, rows]
    else:
        o, m = out_acc.index_select(2, rows), lse_acc.index_select(2, rows)
    lse_b = lse_blk.to(m.dtype)
    new = torch.logaddexp(m, lse_b)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, 0.0)
    w_old = torch.where(finite, torch.exp(m - safe), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(lse_b - safe), 0.0).unsqueeze(-1)
    merged = o * w_old + out_blk.to(o.dtype) * w_new
    if isinstance(rows, slice):
        out_acc[:, :, rows] = merged
        lse_acc[:, :, rows] = new
    else:
        out_acc.index_copy_(2, rows, merged)
        lse_acc.index_copy_(2, rows, new)
