"""Resharding Bridge checkpoints across CP layouts: saved under hierarchical CP, resumed elsewhere.

The run is Megatron-Bridge 0.6.2's own Qwen3 recipe
(``qwen3_600m_pretrain_1gpu_h100_bf16_config``, its provider from ``AutoBridge``: q/k norms,
GQA) built offline from a tiny ``transformers`` config (``tests/unit/bridge/_families.py``: 2
layers, hidden 64, 4 heads / 2 KV heads of 16, vocabulary 256) and made a CPU fp32 run on
Bridge's mock data (``cpu_fp32``: 64-token rows, global batch 8, Adam, no distributed
optimizer); it trains through Bridge's ``pretrain()`` and ``gpt_step.forward_step`` on 4 gloo
ranks and checkpoints with Bridge's own ``torch_dist`` checkpoints, set through Bridge's
overrides as a user sets them (``checkpoint.save``, ``checkpoint.save_interval``,
``checkpoint.load``, ``checkpoint.ckpt_step``). The ranks are not daemonic: megatron's
checkpoint writer starts a process of its own.

One uninterrupted run of 6 steps under CP4 ``a2a+p2p`` [2,2] (the zigzag layout) saves at
step 3 (and 6). Resumed from its step-3 checkpoint for steps 4-6 in

* the same layout (the control),
* CP2 x DP2 (``p2p``): half the CP ranks become data-parallel ranks,
* the contiguous layout (``model.cp_partition_mode=contiguous``), CP4 ``p2p`` and CP4
  ``a2a+p2p`` [2,2]: Bridge's own batch step cuts zigzag with static CP (that config is refused,
  ``test_bridge_loop``), so the contiguous layout runs as dynamic CP
  (``model.hybrid_context_parallel``, a token cap of 16 per rank: every 64-token row is cut over
  a group of all 4 ranks),

the resumed steps equal steps 4-6 of the uninterrupted run - lm loss and grad norm within 1e-5
relative (every CP layout trains like CP=1 within 1e-5 in fp32, which the project's other
Bridge tests show, so the uninterrupted reference is the CP4 [2,2] run itself) - and the resume
really loaded the checkpoint: Bridge's count continues at iteration 4, the data at sample 24,
and the first resumed loss is not a fresh model's.

Negative controls show the comparison can fail: resumed at CP2 x DP2 without the optimizer
state (``checkpoint.load_optim=false``) step 4 - the weights alone - still equals, steps 5-6 do
not; the step-6 checkpoint resumed for steps 7-9 is not steps 4-6.

Not covered: the distributed optimizer. megatron-core 0.19.2's ``DistributedOptimizer`` takes
CUDA parameters only, so it cannot run on this CPU at all (pinned by the last test).

``python -m tests.unit.bridge.test_bridge_resharding --world 8`` (a manual check: 8 ranks) saves
under CP4 [2,2] x DP2 and resumes, as the control, in that layout and under CP8 ``a2a+p2p``
[4,2] (DP1), printing the largest deviations from the uninterrupted run; ``--world 4`` prints
the deviations of this module's layouts.
"""

from __future__ import annotations

import math

import pytest

from tests.unit.bridge._bridge import HCP, REAL

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only: the "
    "py312 leg runs these (MEGATRON_HCP_STACK=py312)")]

MODULE = "tests.unit.bridge.test_bridge_resharding"
WORLD = 4
RTOL = 1e-5
STEPS = 6
SAVED_AT = 3
GLOBAL_BATCH = 8  # cpu_fp32's

# static CP in the contiguous layout is refused in Bridge (its batch step cuts zigzag): dynamic
# CP, 16 tokens a rank - every 64-token row on a group of all 4 ranks
CONTIGUOUS = ["model.hybrid_context_parallel=true", "model.max_seqlen_per_dp_cp_rank=16",
              "model.cp_partition_mode=contiguous"]
LAYOUTS = {  # the layout a run resumes in -> its overrides (4 ranks)
    "hcp_2x2": HCP,  # the saved layout: the control
    "cp2_dp2": ["model.context_parallel_size=2", "model.cp_comm_type=p2p"],
    "cp4_contiguous": ["model.context_parallel_size=4", "model.cp_comm_type=p2p", *CONTIGUOUS],
    "hcp_2x2_contiguous": [*HCP, *CONTIGUOUS],
}
DISTRIBUTED_OPTIMIZER = ["optimizer.use_distributed_optimizer=true",
                         "ddp.use_distributed_optimizer=true"]
# 8 ranks (main): saved under CP4 [2,2] x DP2, resumed under CP8 [4,2]
LAYOUTS8 = {
    "hcp_2x2_dp2": HCP,
    "hcp_4x2": ["model.context_parallel_size=8", "model.cp_comm_type=a2a+p2p",
                "model.hierarchical_context_parallel_sizes=[4,2]"],
}


# ------------------------------------------------------------------------------ on each rank
def tiny_qwen3_config(config_dir: str, train_iters: int = STEPS):
    """Bridge's Qwen3 recipe from the tiny config in ``config_dir``, a CPU fp32 run."""
    from megatron_hcp.bridge.offline import recipe_from_hf_config
    from tests.unit.bridge._families import RECIPES, cpu_fp32

    return cpu_fp32(recipe_from_hf_config(RECIPES["qwen3"], config_dir), train_iters=train_iters)


def resharding_run(config_dir: str, overrides: list[str], steps: int = STEPS) -> dict:
    """Train :func:`tiny_qwen3_config` with Bridge's ``overrides`` (checkpointing included)
    through Bridge's ``pretrain`` on this rank: the gathered history (``loss``, ``grad_norm``
    per step), and Bridge's own count after each step (``iteration``,
    ``samples_before``: the samples consumed before it) and when training started
    (``start_iteration``), and the layout it ran in (``layout``: CP and DP sizes, the token
    layout; ``positions``: every rank's position ids of its first micro-batch, as the model
    received them); ``dynamic_cp``: each step's dynamic-CP plan record (None without)."""
    import torch.distributed as dist

    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.pg_utils import get_pg_collection

    from megatron_hcp.functional.bridge_recipe import build_bridge_config
    from megatron_hcp.parallel_state.collection import destroy_pg_collection

    counts: dict = {"iteration": [], "samples_before": []}
    kept: dict = {}

    def first_positions(module, args, kwargs):
        if "positions" not in kept and kwargs.get("position_ids") is not None:
            kept["positions"] = kwargs["position_ids"].reshape(-1).tolist()

    class Counts(Callback):
        def on_train_start(self, context):
            from megatron.core.models.gpt import GPTModel
            from megatron.core.utils import get_model_config

            for module in context.model[0].modules():
                if isinstance(module, GPTModel):
                    module.register_forward_pre_hook(first_positions, with_kwargs=True)
            pgc = kept["pgc"] = get_pg_collection(context.model[0])
            counts["start_iteration"] = context.state.train_state.step
            counts["layout"] = {"cp": pgc.cp.size(), "dp": pgc.dp.size(), "partition": getattr(
                get_model_config(context.model[0]), "cp_partition_mode", "zigzag")}

        def on_train_step_end(self, context):
            state = context.state.train_state
            # Bridge counts the step just trained (and its samples) after this callback
            # (train.py:564): the step as Bridge logs it, and where its data started
            counts["iteration"].append(state.step + 1)
            counts["samples_before"].append(state.consumed_train_samples)

        def on_train_end(self, context):
            positions: list = [None] * dist.get_world_size()
            dist.all_gather_object(positions, kept.get("positions"))
            counts["layout"]["positions"] = positions

    cfg = build_bridge_config(f"{MODULE}:tiny_qwen3_config", {"config_dir": config_dir},
                              overrides, steps=steps, allowed_modules=[MODULE])
    recorder = metrics_recorder()
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, Counts()])
    finally:
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    history = recorder.history
    return {"loss": history["loss"], "grad_norm": history["grad_norm"],
            "dynamic_cp": history["dynamic_cp"], **counts}


# ------------------------------------------------------------------------------ helpers
def saving(directory: str) -> list[str]:
    return [f"checkpoint.save={directory}", f"checkpoint.save_interval={SAVED_AT}"]


def resuming(directory: str, step: int = SAVED_AT) -> list[str]:
    return [f"checkpoint.load={directory}", f"checkpoint.ckpt_step={step}"]


def deviations(run: dict, reference: dict) -> dict[str, float]:
    """Largest relative deviation of lm loss and grad norm, ``run``'s steps against the last
    steps of ``reference``."""
    tail = -len(run["loss"])
    return {key: max(abs(a - b) / abs(b) for a, b in zip(run[key], reference[key][tail:]))
            for key in ("loss", "grad_norm")}


def _run(world, config_dir: str, overrides: list[str], steps: int = STEPS) -> dict:
    per_rank = world.run(resharding_run, config_dir, overrides, steps, timeout_s=1200)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the gathered history"
    return per_rank[0]


_RUNS: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from tests.unit.bridge._families import write_tiny_config

    path = tmp_path_factory.mktemp("bridge-resharding")
    write_tiny_config("qwen3", path / "qwen3")
    return path


def _history(world, root, name: str, overrides: list[str], steps: int = STEPS) -> dict:
    if name not in _RUNS:
        _RUNS[name] = _run(world, str(root / "qwen3"), overrides, steps)
    return _RUNS[name]


def _saved(world, root) -> dict:
    """The uninterrupted CP4 [2,2] run, saving at step 3 (and 6) into ``root/ckpt``."""
    return _history(world, root, "saved", [*HCP, *saving(str(root / "ckpt"))])


def _resumed(world, root, layout: str, extra: tuple[str, ...] = ()) -> dict:
    _saved(world, root)
    return _history(world, root, f"resumed:{layout}:{extra}",
                    [*LAYOUTS[layout], *resuming(str(root / "ckpt")), *extra])


def _layout(run: dict) -> dict:
    """CP and DP sizes of ``run``, and its token layout - told by the model config and seen in
    the position ids each rank's model received: every rank one slice, or the zigzag's two
    chunks (r and 2cp-1-r: apart on every rank but the last, cp-1)."""
    layout = dict(run["layout"])
    positions = layout.pop("positions")
    one_slice = [p == list(range(p[0], p[0] + len(p))) for p in positions]
    assert (layout["partition"] == "contiguous") == all(one_slice), (layout, positions)
    return layout


EXPECTED = {  # layout -> what the resumed run ran in: CP and DP sizes, the layout
    "hcp_2x2": {"cp": 4, "dp": 1, "partition": "zigzag"},
    "cp2_dp2": {"cp": 2, "dp": 2, "partition": "zigzag"},
    "cp4_contiguous": {"cp": 4, "dp": 1, "partition": "contiguous"},
    "hcp_2x2_contiguous": {"cp": 4, "dp": 1, "partition": "contiguous"},
}


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_hcp_checkpoint_resumes_in_another_cp_layout_like_the_uninterrupted_run(
        world, root, layout):
    full = _saved(world, root)
    run = _resumed(world, root, layout)
    assert len(full["loss"]) == STEPS and len(run["loss"]) == STEPS - SAVED_AT
    assert _layout(full) == EXPECTED["hcp_2x2"] and _layout(run) == EXPECTED[layout]
    dynamic = run["dynamic_cp"]
    if "contiguous" in layout:  # every step ran dynamic CP's plan, every row on 4 ranks
        assert all(plan and set(plan["group_sizes"]) == {4} for plan in dynamic), dynamic
        hierarchical = [plan["hierarchical_groups"] for plan in dynamic]
        assert all(hierarchical) if layout.startswith("hcp") else not any(hierarchical)
    else:
        assert dynamic == [None] * len(dynamic)
    # Bridge's own count continues from the checkpoint's: iterations 4-6, their data from
    # sample 24 on (8 a step)
    assert run["start_iteration"] == SAVED_AT, run["start_iteration"]
    assert run["iteration"] == full["iteration"][SAVED_AT:] == [4, 5, 6], run["iteration"]
    assert run["samples_before"] == full["samples_before"][SAVED_AT:] == [
        step * GLOBAL_BATCH for step in range(SAVED_AT, STEPS)]
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(run[key], full[key][SAVED_AT:]), SAVED_AT + 1):
            assert math.isfinite(a) and abs(a - b) <= RTOL * abs(b), (layout, key, step, a, b)
    # the checkpoint's weights, not a fresh model's: step 4 is far from step 1
    assert abs(run["loss"][0] - full["loss"][0]) > 100 * RTOL * full["loss"][0]


def test_the_comparison_fails_without_the_optimizer_state(world, root):
    """Negative control: resumed at CP2 x DP2 with ``checkpoint.load_optim=false`` (the weights
    only; Adam's moments and step count start afresh) step 4 still equals the uninterrupted
    run's, steps 5-6 do not: a resharding that lost the optimizer state would fail above."""
    full = _saved(world, root)
    run = _resumed(world, root, "cp2_dp2", ("checkpoint.load_optim=false",))
    assert run["iteration"] == [4, 5, 6] and _layout(run) == EXPECTED["cp2_dp2"]
    reference = full["loss"][SAVED_AT:]
    assert abs(run["loss"][0] - reference[0]) <= RTOL * reference[0]
    for step in (1, 2):
        assert abs(run["loss"][step] - reference[step]) > 100 * RTOL * reference[step], (
            step, run["loss"], reference)
    assert deviations(run, full)["grad_norm"] > 100 * RTOL


def test_the_comparison_fails_from_a_checkpoint_of_another_step(world, root):
    """Negative control: the uninterrupted run's step-6 checkpoint resumed at CP2 x DP2 for
    steps 7-9 is not steps 4-6 (the comparison tells which checkpoint was loaded). 9 steps
    instead of 6 change the scheduler's decay length, which megatron's scheduler refuses to
    differ from the checkpoint's unless told to override it (the LR is constant)."""
    full = _saved(world, root)
    run = _history(world, root, "resumed:cp2_dp2:step6", [
        *LAYOUTS["cp2_dp2"], *resuming(str(root / "ckpt"), step=STEPS),
        "scheduler.override_opt_param_scheduler=true"], steps=STEPS + SAVED_AT)
    assert run["start_iteration"] == STEPS and run["iteration"] == [7, 8, 9]
    for key in ("loss", "grad_norm"):
        assert deviations(run, full)[key] > 100 * RTOL, (key, run[key], full[key])


# ------------------------------------------------------------------------------ not covered here
def resharding_failure(config_dir: str, overrides: list[str]) -> str:
    """The traceback of a one-step :func:`resharding_run` ('ran' when it trains)."""
    import traceback

    try:
        resharding_run(config_dir, overrides, steps=1)
    except Exception:  # noqa: BLE001 - the failure is the result
        return traceback.format_exc()
    return "ran"


def test_the_distributed_optimizer_cannot_run_on_a_cpu_so_its_resharding_is_not_covered(
        world, root):
    """megatron-core 0.19.2's ``DistributedOptimizer`` takes CUDA parameters only
    (``distrib_optimizer.py: _build_model_and_main_param_groups`` raises TypeError for a
    ``torch.FloatTensor``), so with ``optimizer/ddp.use_distributed_optimizer=true`` Bridge's
    setup fails on this CPU before any step, in any CP layout: resharding its state (Bridge's
    ``dp_reshardable`` checkpoints over the DPxCP group) is not checked here. When this test
    fails, the distributed optimizer runs: add it to the layouts above."""
    failures = world.run(resharding_failure, str(root / "qwen3"), [*HCP, *DISTRIBUTED_OPTIMIZER],
                         timeout_s=1200)
    for failure in failures:
        assert "_build_model_and_main_param_groups" in failure, failure[-2000:]
        assert "Wrapped parameters must be one of torch.cuda.FloatTensor" in failure


# ------------------------------------------------------------------------------ manual: 8 ranks
def main() -> None:
    import argparse
    import importlib
    import tempfile
    import time
    from pathlib import Path

    from megatron_hcp.harness.local_world import LocalWorld
    from tests.unit.bridge._families import write_tiny_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=(4, 8), default=8)
    args = parser.parse_args()
    module = importlib.import_module(MODULE)  # the ranks import the functions by this name
    layouts = LAYOUTS8 if args.world == 8 else LAYOUTS
    saved_in = "hcp_2x2_dp2" if args.world == 8 else "hcp_2x2"
    with (tempfile.TemporaryDirectory() as tmp,
          LocalWorld(args.world, daemon=False).start() as world):
        config = str(write_tiny_config("qwen3", Path(tmp) / "qwen3"))
        ckpt = str(Path(tmp) / "ckpt")
        started = time.perf_counter()
        per_rank = world.run(module.resharding_run, config, [*layouts[saved_in], *saving(ckpt)],
                             STEPS, timeout_s=3600)
        full = per_rank[0]
        print(f"saved under {saved_in} ({_layout(full)}) on {args.world} ranks at step {SAVED_AT} "
              f"({time.perf_counter() - started:.0f} s); losses {full['loss']}", flush=True)
        for layout, overrides in layouts.items():
            started = time.perf_counter()
            run = world.run(module.resharding_run, config, [*overrides, *resuming(ckpt)],
                            STEPS, timeout_s=3600)[0]
            dev = deviations(run, full)
            print(f"resumed under {layout} ({_layout(run)}): iterations {run['iteration']}, "
                  f"start "
                  f"{run['start_iteration']}, loss dev {dev['loss']:.2e}, grad norm dev "
                  f"{dev['grad_norm']:.2e}, equal at {RTOL:g}: "
                  f"{'yes' if max(dev.values()) <= RTOL else 'NO'} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
