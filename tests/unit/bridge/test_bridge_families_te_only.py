"""Families whose Bridge spec has Transformer Engine layers only - Gemma 3 and Nemotron-H -
through Megatron-Bridge's own ``pretrain()`` with hierarchical CP, on 4 gloo ranks.

**Gemma 3**: Bridge 0.6.2's own recipe (``gemma3_1b_pretrain_1gpu_h100_bf16_config``: Bridge's
``Gemma3ModelProvider`` with its own layer spec) shrunk to 6 layers (``tests/unit/bridge/
_families.py: tiny_direct_recipe``) and made a CPU fp32 run: five sliding-window layers (32
tokens, on 64-token sequences) then a global one, each with its own RoPE base; zero-centred
RMSNorms, q/k norms and the post-attention / post-MLP norms; embeddings scaled by sqrt(hidden);
the recipe's softmax scale. Bridge's Gemma 3 spec is written with Transformer Engine's modules
only; on this CPU megatron-hcp's spec gives their local twins
(:mod:`megatron_hcp.bridge.local_layers`) with its CP attention holding each layer's window.

**Nemotron-H**: Bridge's own ``nemotronh_4b_pretrain_1gpu_h100_bf16_config`` (Bridge's
``HybridModelProvider``, megatron's hybrid stack) shrunk to the hybrid's attention and MLP layers
(pattern ``*-*-``): megatron's hybrid stack spec has TE layers only, whose attention / MLP layers
get their local twins here, and its final norm is TE's always (megatron-hcp's
``hybrid-final-norm-without-te``). Its Mamba layers cannot run on a CPU: megatron's
``MambaMixer`` needs ``mamba_ssm``'s Triton kernels (``mamba_chunk_scan_combined``,
``selective_state_update``) and ``causal_conv1d`` - a pattern with ``M`` is refused at build by
megatron's own ImportError, which the last test pins.

Each family: CP4 ``a2a+p2p`` [2,2] on Bridge's decentralized path and on the MPU path trains
like the same recipe with CP=1 (the CP ranks become data-parallel ranks): lm loss and grad norm
per step, within 1e-5 relative, 5 steps.
"""

from __future__ import annotations

import math

import pytest

from tests.unit.bridge._bridge import REAL
from tests.unit.bridge.family_matrix import DECENTRALIZED, HCP

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only: the "
    "py312 leg runs these (MEGATRON_HCP_STACK=py312)")]

WORLD = 4
RTOL = 1e-5
STEPS = 5



def family_run(family: str, overrides: list[str], steps: int = STEPS,
               revert: tuple[str, ...] = ()) -> dict:
    """Train ``family``'s tiny recipe through Bridge's ``pretrain`` on this rank: the history
    (``loss``, ``grad_norm`` per step), each attention layer's window, and the modules the
    layers were built from. ``revert``: megatron-hcp's Bridge family patches taken off."""
    from megatron_hcp.bridge.family_patches import BRIDGE_FAMILY_PATCHES
    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment
    from megatron_hcp.patching.registry import apply
    from megatron_hcp.patching.registry import revert as take_off

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.training.utils.pg_utils import get_pg_collection

    from megatron_hcp.parallel_state.collection import destroy_pg_collection
    from tests.unit.bridge._families import cpu_fp32, tiny_direct_recipe

    kept: dict = {}

    class Record(Callback):
        def on_train_start(self, context):
            kept["pgc"] = get_pg_collection(context.model[0])
            layers = list(context.model[0].module.decoder.layers) if hasattr(
                context.model[0], "module") else list(context.model[0].decoder.layers)
            kept["windows"] = [layer.self_attention.core_attention.window_size
                               for layer in layers
                               if hasattr(layer.self_attention, "core_attention")]
            kept["modules"] = sorted({type(m).__name__ for layer in layers
                                      for m in layer.modules()})

    cfg = cpu_fp32(tiny_direct_recipe(family), train_iters=steps)
    cfg.dist.distributed_backend = "gloo"
    process_config_with_overrides(cfg, cli_overrides=list(overrides) or None)
    recorder = metrics_recorder()
    off = tuple(p for p in BRIDGE_FAMILY_PATCHES if p.name in revert)
    assert len(off) == len(revert), revert
    take_off(off)
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, Record()])
    finally:
        apply(off)
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    return {"loss": recorder.history["loss"], "grad_norm": recorder.history["grad_norm"],
            "windows": kept["windows"], "modules": kept["modules"]}


_RUNS: dict = {}


def family_failure(family: str, overrides: list[str], revert: tuple[str, ...]) -> str:
    """The failure's text of one :func:`family_run` step ('ran' when it trains)."""
    import traceback

    try:
        family_run(family, overrides, 1, revert)
    except Exception:  # noqa: BLE001 - the failure is the result
        return traceback.format_exc()
    return "ran"


def _history(world, family: str, overrides: list[str]) -> dict:
    key = (family, tuple(overrides))
    if key not in _RUNS:
        per_rank = world.run(family_run, family, overrides, timeout_s=900)
        assert all(h == per_rank[0] for h in per_rank), "ranks disagree on the gathered history"
        _RUNS[key] = per_rank[0]
    return _RUNS[key]


def _assert_same(run: dict, base: dict) -> None:
    assert len(run["loss"]) == len(base["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(run[key], base[key]), 1):
            assert math.isfinite(a) and abs(a - b) <= RTOL * abs(b), (key, step, a, b)


FEATURES = {  # family: (each attention layer's window, modules the layers must hold)
    "gemma3": ([(31, 0)] * 5 + [None],  # five windowed layers, then a global one
               ("Gemma3SelfAttention", "ZeroCenteredGammaNorm", "RowParallelLinearPostNorm",
                "LayerWindowCPAttention")),
    "nemotron_h": ([None, None], ("MLPLayer", "ReferenceCPAttention", "SelfAttention")),
}


@pytest.mark.parametrize("path", ["decentralized", "mpu"])
@pytest.mark.parametrize("family", sorted(FEATURES))
def test_te_only_family_trains_with_hcp_like_its_cp1_twin(world, family, path):
    extra = DECENTRALIZED if path == "decentralized" else []
    run = _history(world, family, [*HCP, *extra])
    twin = _history(world, family, extra)
    _assert_same(run, twin)
    windows, modules = FEATURES[family]
    assert run["windows"] == windows
    for module in modules:
        assert module in run["modules"], run["modules"]
    assert run["loss"][-1] < run["loss"][0]


def test_without_the_groups_patch_gemma3_fails_on_the_decentralized_path(world):
    """Bridge 0.6.2's Gemma 3 provider rebuilds the embedding and RoPE without process groups;
    on the decentralized path (no global groups) the embedding's forward fails at once."""
    failures = world.run(family_failure, "gemma3", [*HCP, *DECENTRALIZED],
                         ("bridge-gemma3-model-groups",), timeout_s=900)
    for failure in failures:
        assert "'NoneType' object has no attribute 'size'" in failure, failure[-2000:]
