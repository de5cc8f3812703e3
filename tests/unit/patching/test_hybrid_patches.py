"""``hybrid-final-norm-without-te``: the hybrid stack's final norm without Transformer Engine.

megatron-core builds the final norm of its hybrid stack (0.19's ``HybridStack``, 0.16's
``MambaStack``) with TE's ``TENorm`` always. Without TE (this machine) the patch puts
megatron-hcp's torch norm in that name: the norm the config asks for, a zero-centred gain, the
sequence-parallel mark; reverting gives TE's name back. Nemotron-H building and training with it
through Bridge: ``tests/unit/bridge/test_bridge_spec.py`` and
``tests/unit/bridge/test_bridge_families_te_only.py`` (py312).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from megatron_hcp.layers.norm import SequenceParallelTorchNorm, ZeroCenteredGammaNorm
from megatron_hcp.patching import by_name
from megatron_hcp.patching.registry import apply, is_applied, megatron_core_version, revert

_HOMES = {"0.16.1": "megatron.core.ssm.mamba_block",
          "0.19.2": "megatron.core.models.hybrid.hybrid_block"}


def _config(**fields):
    base = dict(normalization="RMSNorm", layernorm_zero_centered_gamma=False,
                sequence_parallel=False, persist_layer_norm=False,
                memory_efficient_layer_norm=False)
    return SimpleNamespace(**{**base, **fields})


def test_the_final_norm_name_holds_a_torch_norm_without_te():
    from megatron.core.extensions import transformer_engine as te_ext

    if getattr(te_ext, "HAVE_TE", False):
        pytest.skip("Transformer Engine imports: the patch keeps TENorm")
    version = megatron_core_version()
    home = importlib.import_module(_HOMES[version])
    patch = by_name(["hybrid-final-norm-without-te"])
    assert patch[0].supports()
    was_applied = is_applied(patch[0])
    revert(patch)  # an earlier run of this process may have applied it (Bridge's set-up does)
    te_norm = home.TENorm
    apply(patch)
    try:
        assert home.TENorm is SequenceParallelTorchNorm
        norm = home.TENorm(config=_config(layernorm_zero_centered_gamma=True,
                                          sequence_parallel=True), hidden_size=8, eps=1e-6)
        assert isinstance(norm, ZeroCenteredGammaNorm)
        assert all(p.sequence_parallel for p in norm.parameters())
        x = torch.randn(3, 8)
        want = torch.nn.functional.rms_norm(x, (8,), None, 1e-6)  # gain 1 + 0 at the start
        torch.testing.assert_close(norm(x), want)
        plain = home.TENorm(config=_config(normalization="LayerNorm"), hidden_size=8)
        assert isinstance(plain, torch.nn.LayerNorm)
    finally:
        revert(patch)
    assert home.TENorm is te_norm
    if was_applied:
        apply(patch)
