"""Transformer Engine availability: a missing TE falls back quietly, a broken one is named."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from megatron_hcp.attention.module import ReferenceCPAttention, core_attention_class
from megatron_hcp.attention.te import have_te, te_unavailable_reason


def _forget_te(monkeypatch) -> None:
    """No TE module in this process (other tests may have put an import-only shim there)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)


def test_missing_te_falls_back_without_noise(monkeypatch, caplog):
    _forget_te(monkeypatch)
    assert te_unavailable_reason() == "Transformer Engine is not installed"
    with caplog.at_level(logging.WARNING, logger="megatron_hcp"):
        assert have_te() is False
    assert caplog.text == ""
    assert core_attention_class("auto") is ReferenceCPAttention
    with pytest.raises(RuntimeError, match="needs Transformer Engine: Transformer Engine is not"):
        core_attention_class("te")


def test_a_broken_te_is_named_not_silently_replaced(monkeypatch, caplog):
    _forget_te(monkeypatch)
    broken = types.ModuleType("transformer_engine")  # not a package: transformer_engine.pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", broken)  # cannot import
    reason = te_unavailable_reason()
    assert reason.startswith("transformer_engine is installed but does not import"), reason
    with caplog.at_level(logging.WARNING, logger="megatron_hcp"):
        assert have_te() is False
    assert "Transformer Engine is unusable" in caplog.text and "does not import" in caplog.text
    assert core_attention_class("auto") is ReferenceCPAttention  # logged, not silent
    with pytest.raises(RuntimeError, match="installed but does not import"):
        core_attention_class("te")
