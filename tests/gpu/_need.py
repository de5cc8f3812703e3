"""What a GPU check needs (CUDA GPUs, Transformer Engine) and the reason it is skipped without.

Every module of ``tests/gpu`` is marked ``gpu``: the default test run deselects it (pyproject's
``addopts``), ``./scripts/gpu_check.sh`` runs it (``-m gpu``). On a machine without the GPUs a
check needs, it is skipped with a reason that says how many it needs and how many there are.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["gpu_count", "missing_gpus", "needs", "te_missing"]


def gpu_count() -> int:
    """CUDA GPUs torch sees here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_gpus(n: int) -> str | None:
    """Why a check needing ``n`` GPUs cannot run here, or None when it can."""
    have = gpu_count()
    if have >= n:
        return None
    plural = "GPU" if n == 1 else "GPUs"
    if have == 0:
        return f"needs {n} CUDA {plural}; none here (torch.cuda.is_available() is False)"
    return f"needs {n} CUDA {plural}; this machine has {have}"


def needs(gpus: int, *, te: bool = False) -> pytest.MarkDecorator:
    """Skip, with every missing requirement as the reason, unless this machine has ``gpus``
    CUDA GPUs (and, with ``te``, Transformer Engine)."""
    missing = [m for m in (missing_gpus(gpus), te_missing() if te else None) if m]
    return pytest.mark.skipif(bool(missing), reason="; ".join(missing))


def te_missing() -> str | None:
    """Why Transformer Engine cannot be used here, or None (imports megatron-core)."""
    from megatron_hcp.attention.te import te_unavailable_reason

    reason = te_unavailable_reason()
    return None if reason is None else f"needs Transformer Engine: {reason}"
