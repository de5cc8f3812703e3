"""Megatron-Bridge's own training loop (``pretrain``) with megatron-hcp, on 4 gloo ranks.

Bridge 0.6.2 runs unmodified: its ``ConfigContainer`` from its recipe base
(:mod:`megatron_hcp.bridge.recipes`), overrides through its own ``process_config_with_overrides``,
its data sets (mock GPT, packed SFT Parquet), optimizer, scheduler, DDP and
``gpt_step.forward_step``; what cannot run without CUDA is the named CPU runtime
(:mod:`megatron_hcp.bridge.cpu_runtime`). Every layout equals Bridge's own run of the same
recipe with CP=1 (same TP/PP: the CP ranks become data-parallel ranks): lm loss and grad norm
per step, fp32, within 1e-5 relative.
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
STEPS = 3

PRETRAIN = "tiny_llama_pretrain_config"
SFT = "tiny_llama_sft_config"
SFT_ARGS = {"seq_length": 128, "median_length": 24, "sigma": 0.9}
# the token cap must hold the longest possible sequence (seq_length 128) on all DPxCP ranks
DYNAMIC = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=48"]  # DPxCP 4
DYNAMIC2 = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=64"]  # DPxCP 2
PP2 = ["model.pipeline_model_parallel_size=2", "model.variable_seq_lengths=true",
       "model.moe_token_dispatcher_type=alltoall"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]


# ------------------------------------------------------------------------------ on each rank
def bridge_run(recipe: str, overrides: list[str], recipe_args: dict | None = None,
               work_dir: str | None = None, hook: bool = True,
               model_fields: dict | None = None) -> dict:
    """Train ``recipe`` through Bridge's ``pretrain`` on this rank; the gathered history.
    ``hook=False``: without megatron_hcp.bridge.install() (the CPU runtime stays);
    ``model_fields``: set on the built config's model, as a user's Python would."""
    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.pg_utils import get_pg_collection

    import megatron_hcp.bridge as hcp_bridge
    from megatron_hcp.functional.bridge_recipe import build_bridge_config
    from megatron_hcp.parallel_state.collection import destroy_pg_collection

    kept: dict = {}

    class KeepCollection(Callback):  # Bridge never destroys a decentralized collection
        def on_train_start(self, context):
            kept["pgc"] = get_pg_collection(context.model[0])

    if not hook:
        hcp_bridge.uninstall()
    cfg = build_bridge_config(recipe, recipe_args or {}, overrides, steps=STEPS,
                              work_dir=work_dir)
    for name, value in (model_fields or {}).items():
        setattr(cfg.model, name, value)
    recorder = metrics_recorder()
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, KeepCollection()])
    finally:
        if not hook:
            hcp_bridge.install()
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    return recorder.history


def bridge_refusal(recipe: str, overrides: list[str], recipe_args: dict | None = None,
                   work_dir: str | None = None, model_fields: dict | None = None
                   ) -> tuple[str, list[str], int]:
    """Run a config Bridge's loop must refuse: the error's type, the parameters it names, and
    how many process groups were created meanwhile (``torch.distributed``'s own count)."""
    from torch.distributed import distributed_c10d as c10d

    before = c10d._world.group_count
    try:
        bridge_run(recipe, overrides, recipe_args, work_dir, model_fields=model_fields)
    except Exception as err:  # noqa: BLE001 - the error is the result
        names = [v.parameter for v in getattr(err, "violations", [])]
        return type(err).__name__, names, c10d._world.group_count - before
    return "ran", [], c10d._world.group_count - before


def bridge_failure(recipe: str, overrides: list[str], hook: bool) -> str:
    """Run and return the traceback text of the failure ('ran' when it trains)."""
    import traceback

    try:
        bridge_run(recipe, overrides, hook=hook)
    except Exception:  # noqa: BLE001 - the failure is the result
        return traceback.format_exc()
    return "ran"


# ------------------------------------------------------------------------------ helpers
_RUNS: dict = {}


def _history(world, recipe: str, overrides: list[str], work_dir: str | None = None,
             hook: bool = True) -> dict:
    key = (recipe, tuple(overrides), hook)
    if key not in _RUNS:
        args = SFT_ARGS if recipe == SFT else None
        per_rank = world.run(bridge_run, recipe, overrides, args, work_dir, hook,
                             timeout_s=600)
        assert all(h == per_rank[0] for h in per_rank), "ranks disagree on the gathered history"
        _RUNS[key] = per_rank[0]
    return _RUNS[key]


def _assert_same(run: dict, base: dict, rtol: float = RTOL) -> None:
    assert len(run["loss"]) == len(base["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(run[key], base[key]), 1):
            assert math.isfinite(a) and abs(a - b) <= rtol * abs(b), (key, step, a, b)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bridge-sft"))


# ------------------------------------------------------------------------------ static CP
STATIC = {  # layout -> (its overrides, the CP=1 run it must equal)
    "cp4_p2p": (["model.context_parallel_size=4", "model.cp_comm_type=p2p"], []),
    "cp4_a2a": (["model.context_parallel_size=4", "model.cp_comm_type=a2a"], []),
    "hcp_mpu": (HCP, []),
    "hcp_decentralized": (HCP + DECENTRALIZED, []),
    "tp2_sp_cp2_p2p": (TP2 + ["model.context_parallel_size=2"], TP2),
    "pp2_cp2_all_gather": (["model.pipeline_model_parallel_size=2",
                            "model.context_parallel_size=2", "model.cp_comm_type=all_gather"],
                           ["model.pipeline_model_parallel_size=2"]),
}


@pytest.mark.parametrize("layout", sorted(STATIC))
def test_static_cp_layouts_train_like_bridges_cp1_run(world, layout):
    overrides, base = STATIC[layout]
    _assert_same(_history(world, PRETRAIN, overrides), _history(world, PRETRAIN, base))


def test_hcp_on_the_mpu_path_equals_hcp_on_the_decentralized_path(world):
    mpu = _history(world, PRETRAIN, HCP)
    decentralized = _history(world, PRETRAIN, HCP + DECENTRALIZED)
    _assert_same(decentralized, mpu)
    assert mpu["dynamic_cp"] == [None] * STEPS  # static HCP: no dynamic-CP plan ran


def test_cp_changes_nothing_of_bridges_own_initialization(world):
    """Bridge's own init (no re-draw of the weights) is the same for every CP size: the CPU
    runtime keeps the JIT warm-up's random draws, shaped by seq_length // CP, off the CPU
    generator (on a GPU they come from the CUDA generator). Step 1's loss shows it."""
    one = _history(world, PRETRAIN, [])
    for layout in ("cp4_p2p", "cp4_a2a"):
        run = _history(world, PRETRAIN, STATIC[layout][0])
        assert abs(run["loss"][0] - one["loss"][0]) <= RTOL * one["loss"][0], layout


# ------------------------------------------------------------------------------ dynamic CP
DYNAMIC_LAYOUTS = {  # layout -> (overrides, the static CP=1 run it must equal)
    "cp4": (["model.context_parallel_size=4", "model.cp_comm_type=p2p", *DYNAMIC], []),
    "dp4_cp1": (DYNAMIC, []),  # DPxCP 4 with no static CP: groups from DP ranks alone
    "cp4_decentralized": (["model.context_parallel_size=4", *DYNAMIC, *DECENTRALIZED], []),
    "hcp_2x2": (HCP + DYNAMIC, []),
    # the contiguous layout (upstream's model.cp_partition_mode, set on the provider): packed
    # sequences cut into slices per dynamic group, RoPE by the slices' positions
    "cp4_contiguous": (["model.context_parallel_size=4", "model.cp_comm_type=p2p", *DYNAMIC,
                        "model.cp_partition_mode=contiguous"], []),
    "tp2_sp_cp2": (TP2 + ["model.context_parallel_size=2", *DYNAMIC2], TP2),
    "pp2_cp2": (PP2 + ["model.context_parallel_size=2", *DYNAMIC2], PP2),
    "pp2_vpp2_cp2_dev_names": (
        PP2 + ["model.virtual_pipeline_model_parallel_size=2", "model.context_parallel_size=2",
               "model.dynamic_context_parallel=true", "model.min_dynamic_context_parallel_size=1",
               "model.max_seqlen_per_dp_cp_rank=64"],
        PP2 + ["model.virtual_pipeline_model_parallel_size=2"]),
}


@pytest.mark.parametrize("layout", sorted(DYNAMIC_LAYOUTS))
def test_dynamic_cp_trains_through_bridges_loop_like_cp1(world, sft_dir, layout):
    """Bridge's packed SFT data (variable-length sequences in packed rows) scheduled per step
    over dynamic CP groups; every step ran the plan (recorded) with groups of more than one
    rank, and the run equals Bridge's own static CP=1 run on the same rows."""
    overrides, base = DYNAMIC_LAYOUTS[layout]
    run = _history(world, SFT, overrides, sft_dir)
    _assert_same(run, _history(world, SFT, base, sft_dir))
    plans = run["dynamic_cp"]
    assert all(plan is not None for plan in plans), "a step ran without the dynamic-CP plan"
    assert max(max(plan["group_sizes"]) for plan in plans) > 1, plans
    assert run["micro_batches"] == [plan["micro_batches"] for plan in plans]
    if layout == "hcp_2x2":  # groups of 4 ranks run a2a 2 x p2p 2
        assert any(plan["hierarchical_groups"] for plan in plans), plans
    if "vpp2" in layout:
        assert all(plan["micro_batches"] % 2 == 0 for plan in plans), plans


# ------------------------------------------------------------------------------ without the hook
MOCK_DYNAMIC = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=32"]


def test_without_the_hook_bridge_crashes_in_megatrons_own_schedule(world):
    """Bridge 0.6.2 + megatron-core 0.19.2, a dynamic-CP config without pipelining, no hook:
    megatron's ``hybrid_context_parallel_forward_backward`` receives Bridge's ordinary
    micro-batches (Bridge never wraps its data iterator) and fails on every rank."""
    failures = world.run(bridge_failure, PRETRAIN,
                         ["model.context_parallel_size=4", *MOCK_DYNAMIC], False, timeout_s=600)
    for failure in failures:
        assert "hybrid_context_parallel_forward_backward" in failure, failure[-2000:]


def test_without_the_hook_pipelining_trains_static_cp_silently_and_with_it_dynamic(world):
    """With pipeline parallelism megatron's schedules ignore ``hybrid_context_parallel``:
    without the hook Bridge trains static CP - the same losses as the config without the flag,
    and no plan - and says nothing. With the hook the same config runs dynamic CP."""
    layout = [*PP2, "model.context_parallel_size=2"]
    flagged = _history(world, PRETRAIN, [*layout, *MOCK_DYNAMIC], hook=False)
    static = _history(world, PRETRAIN, layout, hook=False)
    _assert_same(flagged, static, rtol=0.0)
    assert flagged["dynamic_cp"] == [None] * STEPS
    hooked = _history(world, PRETRAIN, [*layout, *MOCK_DYNAMIC])
    assert all(plan is not None for plan in hooked["dynamic_cp"])
    assert max(max(plan["group_sizes"]) for plan in hooked["dynamic_cp"]) == 2
    _assert_same(hooked, _history(world, PRETRAIN, PP2))


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("overrides, named", [
    (["model.context_parallel_size=4", "model.cp_comm_type=p2p",
      "model.hierarchical_context_parallel_sizes=[2,2]"], "hierarchical_context_parallel_sizes"),
    ([*DYNAMIC, "model.calculate_per_token_loss=false"], "calculate_per_token_loss"),
    (["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=8"],
     "model.max_seqlen_per_dp_cp_rank"),
    ([*DYNAMIC2, "model.pipeline_model_parallel_size=2", "model.context_parallel_size=2",
      "model.moe_token_dispatcher_type=alltoall"], "model.variable_seq_lengths"),
    (["model.context_parallel_size=4", "model.cp_comm_type=a2a",
      "model.num_query_groups=3"], "num_query_groups"),
    # Bridge's own batch step cuts zigzag: static CP in the contiguous layout is refused
    (["model.context_parallel_size=2", "model.cp_partition_mode=contiguous"],
     "model.cp_partition_mode"),
])
def test_bad_cp_configs_are_refused_on_every_rank_before_any_process_group(world, sft_dir,
                                                                           overrides, named):
    results = world.run(bridge_refusal, SFT, overrides, SFT_ARGS, sft_dir, timeout_s=600)
    for kind, names, groups_created in results:
        assert kind == "CPConfigError" and any(named in n for n in names), (kind, names)
        assert groups_created == 0, "a process group was created before the refusal"


@pytest.mark.parametrize("fields, named", [
    ({"context_parallel_size": "2"}, {"model.context_parallel_size"}),  # was a TypeError
    ({"tensor_model_parallel_size": 2.0, "cp_comm_type": 5},  # every violation together
     {"model.tensor_model_parallel_size", "model.cp_comm_type"}),
])
def test_bad_types_set_in_python_are_named_at_pretrains_entry(world, fields, named):
    """A string size set on Bridge's config in Python: pretrain() refuses it by name on every
    rank before Bridge's own config code (which divided by it) and before any process group."""
    results = world.run(bridge_refusal, PRETRAIN, [], None, None, fields, timeout_s=600)
    for kind, names, groups_created in results:
        assert kind == "CPConfigError" and named <= set(names), (kind, names)
        assert groups_created == 0
