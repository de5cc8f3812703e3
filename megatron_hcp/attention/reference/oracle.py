"""Plain single-process attention on global tensors: the oracle CP attention is checked against.

Written independently of the CP kernels (explicit softmax per sequence, no LSE merging); runs
on the inputs' device.
"""

from __future__ import annotations

import math

import torch

from ...sharding import seq_lengths

__all__ = ["full_attention"]


def _attend(q, k, v, causal, scale, window=None, sink=None, bias=None):
    # q [s, h, d], k [s, hkv, d], v [s, hkv, dv]; window (left, right), -1 = unbounded
    reps = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if bias is not None:  # [h|1, s|1, s] post-scale bias
        scores = scores + bias
    s = q.shape[0]
    pos = torch.arange(s, device=q.device)
    i, j = pos[:, None], pos[None, :]
    visible = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window is not None and window[0] >= 0:
        visible &= j >= i - window[0]
    if window is not None and window[1] >= 0:
        visible &= j <= i + window[1]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:  # one more key per head: logit sink[h], value 0
        column = sink.view(-1, 1, 1).expand(-1, s, 1).to(scores.dtype)
        return torch.einsum("hqk,khd->qhd", torch.cat([scores, column], -1).softmax(-1)[..., :-1],
                            v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    qkv_format: str = "bshd",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    softmax_offset: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over whole (unsharded) tensors; ``thd`` padding rows give 0. ``window_size``
    ``(left, right)``: query i sees keys i-left .. i+right of its sequence (-1 = unbounded).
    ``softmax_offset`` [h]: an extra logit per head in every softmax (a key with value 0).
    ``attention_bias`` [b|1, h|1, s|1, s] (bshd/sbhd): added to the scaled scores."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    w, sink = window_size, softmax_offset
    bias = attention_bias
    if qkv_format == "bshd":
        return torch.stack([_attend(q[b], k[b], v[b], causal, scale, w, sink,
                                    None if bias is None else bias[min(b, bias.shape[0] - 1)])
                            for b in range(q.shape[0])])
    if qkv_format == "sbhd":
        out = full_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             causal=causal, softmax_scale=scale, window_size=w,
                             softmax_offset=sink, attention_bias=bias)
        return out.transpose(0, 1)
    assert cu_seqlens is not None
    padded = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    parts = []
    start = 0
    for n, p in zip(seq_lengths(cu_seqlens), seq_lengths(padded)):
        sl = slice(start, start + n)
        parts.append(_attend(q[sl], k[sl], v[sl], causal, scale, w, sink))
        parts.append(q.new_zeros((p - n, q.shape[1], v.shape[-1])))
        start += p
    return torch.cat(parts)
