"""``window_size`` as megatron and Megatron-Bridge give it, read by the hook's strict reader.

megatron-core's ``TransformerConfig.window_size`` is ``(left, right)`` (-1 = unbounded) or None;
Bridge's Gemma 3 provider sets one integer, ``window_size=512``: a window of 512 tokens, which
its attention turns into ``(511, 0)`` on its sliding-window layers (Bridge's
``mcore_to_hf_window_size`` is the inverse). The reader takes every form and refuses the rest
with a named error. The reader tests run on both stacks (no Bridge, no stand-in); the Gemma 3
tests use Bridge 0.6.2's own provider class (Python 3.12 leg).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_hcp.bridge.config import cp_config_from_bridge, read_window
from megatron_hcp.config import CPConfigError

from . import _bridge

needs_bridge = pytest.mark.skipif(not _bridge.REAL, reason="Megatron-Bridge 0.6.2 needs "
                                  "Python 3.12 (the py312 leg runs these)")


@pytest.mark.parametrize("raw, want", [
    (None, None),
    (512, [511, 0]),          # Bridge's scalar (Gemma 3): 512 tokens, the current one included
    (1, [0, 0]),
    ((127, 0), [127, 0]),     # megatron's tuple
    ([64, 0], [64, 0]),       # a checkpoint's YAML reloads tuples as lists
    ((-1, -1), [-1, -1]),     # unbounded both ways
    ((8, 8), [8, 8]),
])
def test_every_form_megatron_and_bridge_give(raw, want):
    assert read_window(raw) == want
    assert cp_config_from_bridge(SimpleNamespace(window_size=raw)).window_size == want


@pytest.mark.parametrize("raw, want", [
    ("512", "[511,0]"), (" +8 ", "[7,0]"), ("[127,0]", "[127,0]"),
    ("\u00b9", "\u00b9"),   # a superscript one: str.isdigit() says yes, int() refuses; left
    ("\u0664", "\u0664"),   # to the strict reader, like any text that is not a plain integer
])
def test_a_window_override_is_rewritten_only_when_it_is_a_plain_integer(raw, want):
    from megatron_hcp.bridge.config import window_override

    assert window_override(raw) == want


@pytest.mark.parametrize("raw, says", [
    (0, "token count and must be >= 1"),
    (-1, "token count and must be >= 1"),
    (True, "not a bool"),
    (512.0, "not a float"),
    ("512", "not text"),
    ((1, "0"), "not text"),
    ([128], "not 1 values"),
    ((1, 2, 3), "not 3 values"),
    ({"left": 1}, "not a dict"),
    ((1.5, 0), r"window_size\[0\]=1.5"),
    ((True, 0), r"window_size\[0\]=True"),
    ((-2, 0), r"window_size\[0\]=-2"),
])
def test_anything_else_is_a_named_error(raw, says):
    with pytest.raises(CPConfigError, match=says) as err:
        cp_config_from_bridge(SimpleNamespace(window_size=raw))
    assert [v.parameter.split("[")[0] for v in err.value.violations] == ["model.window_size"]


def test_an_integer_window_is_a_window_for_the_cp_rules():
    """512 is a sliding window: the rule that Transformer Engine runs windows with CP only on
    a2a / all_gather applies to it as to (511, 0)."""
    for window in (512, (511, 0)):
        model = SimpleNamespace(window_size=window, context_parallel_size=2, cp_comm_type="p2p")
        with pytest.raises(CPConfigError, match="sliding-window"):
            cp_config_from_bridge(model, te_version="2.8.0").resolve()
        model.cp_comm_type = "a2a"
        assert cp_config_from_bridge(model, te_version="2.8.0").resolve().cp == 2


# ------------------------------------------------------------- Bridge's Gemma 3 provider
@pytest.fixture
def gemma3():
    mods = _bridge.load()
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3ModelProvider

    yield lambda **kw: Gemma3ModelProvider(**{
        "num_layers": 6, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 16, "vocab_size": 128, "seq_length": 256, **kw})
    del mods
    _bridge.release()


@needs_bridge
def test_gemma3_provider_window_is_read(gemma3):
    from megatron.bridge.models.conversion.utils import mcore_to_hf_window_size

    provider = gemma3()
    assert provider.window_size == 512  # Bridge's own default, an int
    config = cp_config_from_bridge(provider)
    assert config.window_size == [511, 0]
    assert mcore_to_hf_window_size(config.window_size) == provider.window_size  # Bridge's inverse


@needs_bridge
@pytest.mark.parametrize("cp, comm", [(1, "p2p"), (2, "a2a"), (4, "p2p")])
def test_gemma3_passes_bridge_runtime_config_update(gemma3, monkeypatch, cp, comm):
    """The path that refused Gemma 3 on every rank: Bridge's runtime_config_update as
    ``install()`` wraps it (bridge-cp-setup) reads the model config first. CP=4 p2p runs on the
    reference backend (no TE here), which runs windows with every comm type."""
    from megatron_hcp.bridge import dynamic_cp

    monkeypatch.setenv("WORLD_SIZE", str(cp))  # torchrun's, as Bridge's ranks see it
    cfg = SimpleNamespace(model=gemma3(context_parallel_size=cp, cp_comm_type=comm),
                          dist=None)
    wrapped = dynamic_cp._make_runtime_config_update(lambda c, *a, **k: "bridge ran")
    assert wrapped(cfg) == "bridge ran"
    assert dynamic_cp.cp_config_of(cfg.model).window_size == [511, 0]
    assert cfg.model.window_size == 512  # Bridge's value is not changed


@needs_bridge
def test_gemma3_bad_window_still_refused(gemma3):
    from megatron_hcp.bridge import dynamic_cp

    cfg = SimpleNamespace(model=gemma3(window_size="512"), dist=None)
    with pytest.raises(CPConfigError, match=r"model\.window_size='512'.*not text"):
        dynamic_cp._make_runtime_config_update(lambda c: None)(cfg)


@pytest.mark.parametrize("overrides", [["model.window_size=512"], ["model.window_size=[511,0]"]])
def test_the_override_forms_read_alike(overrides):
    """Bridge's ``model.window_size=512`` override reads as the provider's int does; before 0cd5e3b
    (2026-11-29) the override reader refused it ("must be two integers")."""
    from megatron_hcp.bridge import cp_config_from_overrides

    assert cp_config_from_overrides(overrides)[0].window_size == [511, 0]


def test_the_dynamic_cp_workload_reads_an_integer_window():
    """The dynamic-CP data path prices a scalar window as (W-1, 0) (it indexed ``512[0]``)."""
    from megatron_hcp.dynamic_cp.workload import GPTWorkload

    assert GPTWorkload.causal_window(read_window(512)) == 511
