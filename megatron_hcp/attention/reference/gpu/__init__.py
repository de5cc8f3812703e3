"""The attention's GPU-only paths, behind this one seam: FlashAttention-2 varlen calls for a
block's pieces and bands (:mod:`.varlen`, CUDA only) and the merges and masks fused by
``torch.compile`` (:mod:`.fused`, CUDA with Triton in ``auto``; the CPU compiles them only when
asked to, ``MEGATRON_HCP_FUSED_OPS=on``).

The reference path (blocks, kernels, merges, the CP functions) imports from this package only,
never from its modules (``tests/unit/test_architecture.py``), so what runs on every device reads
on its own; each name below says what the reference path asks of a GPU. On a CPU run every
switch here answers "not here" and the reference path runs alone. Packed blocks cut per
sequence (:mod:`..pieces`) and a window's bands (:mod:`..bands`) are plans made on every device
(the CPU runs the plan a GPU would), so they live beside the reference path, not here.
"""

from .fused import FUSED, FUSED_ENV, FUSED_MODES, fused_mode, fuses, fusing, run_fused
from .varlen import (
    VARLEN,
    VARLEN_ENV,
    VARLEN_KERNEL,
    VARLEN_MODES,
    VarlenCall,
    fa2_checked,
    kernel_calls,
    varlen_backward,
    varlen_calls,
    varlen_forward,
    varlen_mode,
    varlen_takes,
    varlening,
)

__all__ = ["FUSED", "FUSED_ENV", "FUSED_MODES", "VARLEN", "VARLEN_ENV", "VARLEN_KERNEL",
           "VARLEN_MODES", "VarlenCall", "fa2_checked", "fused_mode", "fuses", "fusing",
           "kernel_calls", "run_fused", "varlen_backward", "varlen_calls", "varlen_forward",
           "varlen_mode", "varlen_takes", "varlening"]
