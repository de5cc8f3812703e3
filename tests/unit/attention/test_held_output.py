"""reorder.HeldOutput: an attention function's returned output, held for its backward and let
go of there (single process, no groups)."""

from __future__ import annotations

import pytest
import torch

from megatron_hcp.attention.reference.reorder import HeldOutput

pytestmark = pytest.mark.torch_only


def test_applies_only_without_saved_tensor_hooks():
    """Under saved-tensor hooks (offloading, checkpointing) the output is saved as usual."""
    assert HeldOutput.applies()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not HeldOutput.applies()
    assert HeldOutput.applies()


def test_holds_an_alias_and_checks_its_version():
    """The held tensor shares the output's storage (no copy) and has no graph; a change in
    place after the forward is refused with the fix."""
    out = torch.randn(4, 3, requires_grad=True) * 2
    held = HeldOutput(out)
    assert held._out.data_ptr() == out.data_ptr() and held._out.grad_fn is None
    with torch.no_grad():
        out.add_(1)
    with pytest.raises(RuntimeError, match="modified in place .*out-of-place"):
        held.take()


def test_take_outside_a_backward_keeps_it():
    """Outside a backward torch cannot say whether the graph is kept: the output stays."""
    out = torch.randn(2, 2)
    held = HeldOutput(out)
    assert held.take() is held.take()
