"""Transformer Engine availability: a missing TE falls back quietly, a broken one is named, and
an unpatched one is refused naming the te-attention-hcp patch."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

from megatron_hcp.attention.module import ReferenceCPAttention, core_attention_class
from megatron_hcp.attention.te import (
    FORK_DIFF_MARKER,
    TEUnavailableError,
    carries_te_cp_groups,
    have_te,
    te_unavailable_reason,
)


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


REPO = Path(__file__).resolve().parents[3]
# the shape of megatron's TEDotProductAttention that the te-attention-hcp patch wraps (without
# TE, megatron's own class is a MagicMock); a module of its own, so it has a source file
STAND_IN = '''
class TEDotProductAttention:
    """Stand-in for megatron's class: Transformer Engine cannot run here."""

    cp_stream = None

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type="p2p",
                 pg_collection=None):
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None):
        return query
'''


def _te_class(monkeypatch, tmp_path: Path, name: str, head: str = "") -> type:
    path = tmp_path / f"{name}.py"
    path.write_text(head + STAND_IN, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"te_stand_in_{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # a class's source is its module's file
    spec.loader.exec_module(module)
    return module.TEDotProductAttention


def _fork_diff_lines(version: str) -> list[str]:
    """The lines the shipped te-attention-hcp diff of ``version`` adds that carry its marker."""
    (diff,) = (REPO / "patches" / f"megatron-core-{version}").glob("*-te-attention-hcp.patch")
    return [line[1:] for line in diff.read_text(encoding="utf-8").splitlines()
            if line.startswith("+") and not line.startswith("+++") and FORK_DIFF_MARKER in line]


@pytest.mark.parametrize("version", sorted(p.name.split("-")[-1]
                                           for p in (REPO / "patches").glob("megatron-core-*")))
def test_every_te_fork_diff_carries_the_marker_the_te_backend_looks_for(version):
    assert len(_fork_diff_lines(version)) >= 3, version


def test_te_backend_needs_the_te_attention_hcp_patch(monkeypatch, tmp_path):
    """With Transformer Engine importable, backend te (and auto) hands out megatron's
    TEDotProductAttention only with the te-attention-hcp patch - applied at run time by the
    patch registry, or as its fork-style diff in megatron's source - and refuses it, naming the
    patch, otherwise (the check reads the class; attention imports nothing of patching)."""
    from megatron.core.extensions import transformer_engine as te_ext

    from megatron_hcp.patching import apply, by_name, megatron_core_version, revert

    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    plain = _te_class(monkeypatch, tmp_path, "plain")
    monkeypatch.setattr(te_ext, "TEDotProductAttention", plain)
    for backend in ("te", "auto"):
        with pytest.raises(TEUnavailableError, match=r"patches \['te-attention-hcp'\].*apply"):
            core_attention_class(backend)
    patch = by_name(["te-attention-hcp"])
    assert apply(patch) == ["te-attention-hcp"]
    try:
        assert carries_te_cp_groups(plain)
        assert core_attention_class("te") is plain and core_attention_class("auto") is plain
    finally:
        assert revert(patch) == ["te-attention-hcp"]
    with pytest.raises(TEUnavailableError, match="te-attention-hcp"):
        core_attention_class("te")
    head = "".join(f"#{line}\n" for line in _fork_diff_lines(megatron_core_version()))
    forked = _te_class(monkeypatch, tmp_path, "forked", head)
    monkeypatch.setattr(te_ext, "TEDotProductAttention", forked)
    assert core_attention_class("te") is forked


def test_te_refuses_the_contiguous_layout_before_te_runs():
    """TE cuts every sequence zigzag: a CP call in the contiguous layout (from the model config
    or the micro-batch's PackedSeqParams) is refused by name, never run as zigzag; without CP,
    or in the zigzag layout, TE is called. The two sources disagreeing is an error too."""
    from types import SimpleNamespace

    from megatron_hcp.attention.te import TEUnavailableError, require_te_feature
    from megatron_hcp.sharding import ShardingError

    cp = SimpleNamespace(enabled=True, group=object(), dynamic=False)
    off = SimpleNamespace(enabled=False, group=None, dynamic=False)
    contiguous = SimpleNamespace(cp_partition_mode="contiguous")
    for config, params in ((contiguous, None), (SimpleNamespace(), contiguous)):
        with pytest.raises(TEUnavailableError, match="cp_partition_mode='contiguous'"):
            require_te_feature(cp, params, "2.20", config)
    require_te_feature(off, None, "2.20", contiguous)
    require_te_feature(cp, None, "2.20", SimpleNamespace(cp_partition_mode="zigzag"))
    with pytest.raises(ShardingError, match="disagree|another layout"):
        require_te_feature(cp, SimpleNamespace(cp_partition_mode="zigzag"), "2.20", contiguous)
