"""The MLA family (DeepSeek-V3 / Moonlight) through Megatron-Bridge's own ``pretrain`` on 4 gloo
ranks with hierarchical CP, equal to Bridge's CP=1 run.

The model is Bridge's own DeepSeek-V3 provider (``DeepSeekV3Bridge.provider_bridge`` of a tiny
Hugging Face config made in memory:
:func:`megatron_hcp.bridge.recipes.tiny_deepseek_v3_pretrain_config`) - MLA with low-rank q and
kv, YaRN RoPE, a dense layer and a MoE layer (4 experts, top-2, one shared expert, sigmoid
scores with expert bias, the sequence auxiliary loss), one MTP layer - with DeepSeek's own spec
function and megatron-hcp's CP attention (``use_cp_attention``), fp32.
CP4 ``a2a+p2p`` [2,2] on the decentralized path (``dist.use_decentralized_pg=true``) and on the
MPU path each equal Bridge's CP=1 run of the same path (the CP ranks become data-parallel
ranks): lm loss and grad norm per step, 5 steps, within 1e-5 relative; so does TP2+SP x CP2 on
the decentralized path.

What it needs (named patches): ``cpu-yarn-rope-device`` (YaRN's frequencies on the CPU),
``bridge-mtp-block-spec-local`` (Bridge asks for TE's MTP block always), ``bridge-model-groups``
and ``mtp-collection-groups`` (megatron-core's MTP reads the global pipeline and data-parallel
groups, which the decentralized path never creates), ``mla-tp-group`` (MLA's q / kv gathers
read the global TP group), and the MoE CPU runtime (``cpu-moe-router-device``).

MTP under CP: megatron-core 0.19.2 scales each CP rank's MTP token losses by that rank's own
``tokens / tokens after the roll`` (only CP rank 0 loses a token to it), so the MTP gradient
depended on the CP layout (3.8e-5 in grad norm; 2026-11-29, at 01a5cd5, a 2-core x86_64 CPU VM).
``mtp-dynamic-cp-group``, which Bridge's hook applies, takes those counts over the CP group
(:func:`megatron_hcp.patching.integration.with_cp_token_counts`): the MTP layouts equal CP=1 with
nothing but the named patches.
"""

from __future__ import annotations

import math

import pytest

from tests.unit.bridge._bridge import DECENTRALIZED, HCP, REAL

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only: the "
    "py312 leg runs these (MEGATRON_HCP_STACK=py312)")]

WORLD = 4
RTOL = 1e-5
STEPS = 5

RECIPE = "tiny_deepseek_v3_pretrain_config"
PATHS = {"decentralized": DECENTRALIZED,
         "mpu": ["dist.use_decentralized_pg=false"]}


# ------------------------------------------------------------------------------ on each rank
def _architecture(model) -> dict:
    """What the built model is made of (first model chunk)."""
    from megatron.core.utils import get_attr_wrapped_model

    gpt = get_attr_wrapped_model(model[0], "decoder", return_model_obj=True)
    layers = list(gpt.decoder.layers)
    mtp = getattr(gpt, "mtp", None)
    inner = [layer.mtp_model_layer for layer in mtp.layers] if mtp is not None else []
    attention = [layer.self_attention for layer in layers + inner]
    return {
        "attention": [type(a).__name__ for a in attention],
        "core_attention": [type(a.core_attention).__name__ for a in attention],
        "rope": sorted({type(a.rotary_pos_emb).__name__ for a in attention}),
        "rope_device": sorted({str(a.rotary_pos_emb.inv_freq_extra.device) for a in attention}),
        "mlp": [type(layer.mlp).__name__ for layer in layers + inner],
        "experts": [layer.mlp.experts.num_local_experts for layer in layers + inner
                    if type(layer.mlp).__name__ == "MoELayer"],
        "shared_experts": [layer.mlp.shared_experts is not None for layer in layers + inner
                           if type(layer.mlp).__name__ == "MoELayer"],
        "mtp_layers": len(inner),
        "cp_size": gpt.pg_collection.cp.size(),
        "cp_levels": sorted({_levels(a.core_attention.static_groups) for a in attention}),
    }


def _levels(groups) -> str:
    """The attention's CP comm type and its levels' sizes, e.g. ``a2a+p2p [2, 2]``."""
    group = groups.group
    sizes = [g.size() for g in group] if isinstance(group, (list, tuple)) else [groups.size]
    return f"{groups.comm_type} {sizes}"


def _fresh_metric_trackers() -> None:
    """megatron's process-wide MoE and MTP metric trackers as a new process has them: this
    world's ranks train several models, and the MoE tracker keeps the layer count of the first
    (an MTP layer adds one)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker.clear()


def mla_run(overrides: list[str], mtp: bool) -> dict:
    """Train the tiny DeepSeek-V3 through Bridge's ``pretrain`` on this rank for ``STEPS``
    steps (``mtp``: with its MTP layer); the gathered history, the model's architecture and the
    megatron-core patches in effect."""
    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.pg_utils import get_pg_collection

    from megatron_hcp.functional.bridge_recipe import build_bridge_config
    from megatron_hcp.parallel_state.collection import destroy_pg_collection
    from megatron_hcp.patching import ALL_PATCHES, is_applied

    kept: dict = {}

    class Inspect(Callback):  # Bridge never destroys a decentralized collection
        def on_train_start(self, context):
            kept["pgc"] = get_pg_collection(context.model[0])
            kept["architecture"] = _architecture(context.model)
            kept["patches"] = sorted(p.name for p in ALL_PATCHES if is_applied(p))

    _fresh_metric_trackers()
    cfg = build_bridge_config(RECIPE, {"mtp_num_layers": int(mtp)}, overrides, steps=STEPS)
    recorder = metrics_recorder()
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, Inspect()])
    finally:
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    return {**recorder.history, "architecture": kept["architecture"],
            "patches": kept["patches"]}


# ------------------------------------------------------------------------------ helpers
_RUNS: dict = {}


def _history(world, overrides: list[str], mtp: bool) -> dict:
    key = (tuple(overrides), mtp)
    if key not in _RUNS:
        per_rank = world.run(mla_run, overrides, mtp, timeout_s=900)
        assert all(h == per_rank[0] for h in per_rank), "ranks disagree on the gathered history"
        _RUNS[key] = per_rank[0]
    return _RUNS[key]


def _deviation(run: dict, base: dict) -> float:
    """The largest relative difference of lm loss and grad norm over the steps."""
    assert len(run["loss"]) == len(base["loss"]) == STEPS
    worst = 0.0
    for key in ("loss", "grad_norm"):
        for a, b in zip(run[key], base[key]):
            assert math.isfinite(a) and math.isfinite(b), (key, a, b)
            worst = max(worst, abs(a - b) / abs(b))
    return worst


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_hcp_trains_the_mla_family_like_bridges_cp1_run(world, path, mtp):
    """CP4 a2a+p2p [2,2] equals CP=1 on the same path, 5 steps, fp32, within 1e-5 (MTP: with
    its token counts over the CP group, ``mtp-dynamic-cp-group``)."""
    run = _history(world, HCP + PATHS[path], mtp)
    base = _history(world, PATHS[path], mtp)
    assert _deviation(run, base) <= RTOL, (run["loss"], base["loss"], run["grad_norm"],
                                           base["grad_norm"])
    assert run["architecture"]["cp_size"] == 4 and base["architecture"]["cp_size"] == 1


def test_tp2_sp_cp2_on_the_decentralized_path_like_bridges_cp1_run(world):
    """Tensor parallelism with SP beside CP on the decentralized path (MLA's q / kv gathers over
    its own TP group: ``mla-tp-group``), MTP included: equal to TP2 x CP=1."""
    tp2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    path = PATHS["decentralized"]
    run = _history(world, [*tp2, "model.context_parallel_size=2", *path], True)
    base = _history(world, [*tp2, *path], True)
    assert _deviation(run, base) <= RTOL, (run["loss"], base["loss"])
    assert run["architecture"]["cp_levels"] == ["p2p [2]"]


def test_the_model_is_deepseek_v3s_architecture(world):
    """MLA with YaRN RoPE (frequencies on the CPU) in every layer, MTP's included; a dense and a
    MoE layer of 4 experts with a shared expert, MTP's layer MoE too; megatron-hcp's CP
    attention."""
    got = _history(world, HCP + PATHS["decentralized"], True)["architecture"]
    assert got == {
        "attention": ["MLASelfAttention"] * 3, "core_attention": ["ReferenceCPAttention"] * 3,
        "rope": ["YarnRotaryEmbedding"], "rope_device": ["cpu"],
        "mlp": ["MLP", "MoELayer", "MoELayer"], "experts": [4, 4],
        "shared_experts": [True, True], "mtp_layers": 1, "cp_size": 4,
        "cp_levels": ["a2a+p2p [2, 2]"]}


def test_mtp_under_cp_weighs_its_tokens_like_cp1(world):
    """MTP under CP4 a2a+p2p [2,2] equals CP=1 within 1e-5 from the first step's gradient on
    (megatron-core 0.19.2's own per-rank token counts made step 1's grad norm differ by 3.8e-5,
    the forward being the same; 2026-11-29, at 01a5cd5), with nothing but the named patches Bridge's
    hook and the CPU runtime apply: ``mtp-dynamic-cp-group`` (the counts over the CP group) and the
    MLA family's."""
    path = PATHS["decentralized"]
    run = _history(world, HCP + path, True)
    base = _history(world, path, True)
    for key in ("loss", "grad_norm"):
        assert abs(run[key][0] - base[key][0]) <= RTOL * abs(base[key][0]), (key, run, base)
    assert _deviation(run, base) <= RTOL, (run["grad_norm"], base["grad_norm"])
    assert {"mtp-dynamic-cp-group", "cpu-yarn-rope-device", "mtp-collection-groups",
            "mla-tp-group"} <= set(run["patches"])
    assert run["patches"] == base["patches"]
