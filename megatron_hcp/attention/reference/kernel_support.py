"""torch's attention kernels by name, what they accumulate in, and whether torch runs one on
given CUDA tensors - what the block kernels (:mod:`.kernels`) and the GPU paths (:mod:`.gpu`)
both ask, below both."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CPU_FLASH", "CUDA_EFFICIENT", "CUDA_FLASH", "KERNELS", "MATH", "acc_dtype",
           "torch_accepts"]

CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH = "cpu_flash", "cuda_flash", "cuda_efficient", "math"
KERNELS = (CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_accepts(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool, mask: torch.Tensor | Any = None) -> bool:
    """Whether torch runs ``kernel`` on these CUDA tensors here (GPU arch, build, the user's
    ``torch.backends.cuda.enable_*_sdp`` switches), with the block's ``mask`` if it has one
    (a tensor or a :class:`~.masks.BlockMask`: its shape is what is asked); K/V with fewer
    heads than q are asked as grouped-query attention (``enable_gqa``)."""
    from torch.backends import cuda as sdp

    if mask is not None:  # torch checks a mask's dtype, shape and last stride only: one
        # unfilled row seen as every row (no [rows, cols] allocation per check)
        rows, cols = mask.shape
        mask = torch.empty((1, cols), dtype=torch.bool, device=q.device).expand(rows, cols)
    gqa = k.shape[1] != q.shape[1]
    check = (sdp.can_use_flash_attention if kernel == CUDA_FLASH
             else sdp.can_use_efficient_attention)
    # asked as for training (q requires grad, grad mode on, as torch's SDPA front end sees a
    # training call: the block's backward runs the same kernel, and torch refuses some
    # (flash with head dims over 192 on sm86/89/120) for training only; the autograd
    # Function's forward runs with grad mode off, where that check would not run; an
    # inference tensor has no backward and cannot require grad)
    with torch.enable_grad():
        q = q if q.is_inference() else q.detach().requires_grad_()
        try:
            params = sdp.SDPAParams(q, k, v, mask, 0.0, causal, gqa)
        except TypeError:  # torch < 2.5: no enable_gqa argument
            if gqa:
                return False
            params = sdp.SDPAParams(q, k, v, mask, 0.0, causal)
        return bool(check(params, False))
