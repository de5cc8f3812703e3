"""Fixtures of the attention tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from megatron_hcp.attention.reference.gpu import varlen as varlen_module
from megatron_hcp.attention.reference.gpu.varlen import (
    forget_kernel_checks,
    reference_backward,
    reference_forward,
)


def reference_as_fa2(set_attr: Callable[[object, str, object], None]) -> None:
    """FA2's varlen kernel replaced (``set_attr``: ``setattr`` or ``monkeypatch.setattr``) by
    the reference (SDPA per segment), taking every block with one head dim (MLA head dims: not
    taken, as by FA2): the varlen calls then run on the CPU."""
    set_attr(varlen_module, "_fa2_takes",
             lambda q, k, v: q.shape[-1] == k.shape[-1] == v.shape[-1])
    set_attr(varlen_module, "_flash_forward", reference_forward)
    set_attr(varlen_module, "_flash_backward", reference_backward)


@pytest.fixture
def reference_kernel(monkeypatch):
    """:func:`reference_as_fa2` for one test, ``auto``'s kernel check forgotten before and
    after (it then checks the reference, and passes)."""
    forget_kernel_checks()
    reference_as_fa2(monkeypatch.setattr)
    yield
    forget_kernel_checks()
