"""Qwen3-MoE through Megatron-Bridge's own ``pretrain()`` with hierarchical CP, on 4 gloo ranks.

The model is Bridge 0.6.2's own recipe (``qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config``) run
offline from a tiny ``transformers`` Qwen3-MoE config (2 layers, 8 experts of 32, top-2, q/k
norms; :func:`megatron_hcp.bridge.offline.recipe_from_hf_config`), made a CPU fp32 run
(``tests/unit/bridge/_families.py``) with the provider's own spec and megatron-hcp's CP
attention. CP4 ``a2a+p2p`` [2,2] on Bridge's decentralized path trains like the same recipe with
CP=1 (the CP ranks become data-parallel ranks), for EP1 and EP2 with the alltoall and the
allgather dispatcher, every step:

* lm loss and grad norm within 1e-5 (relative);
* the routing: for every layer, the tokens each expert received and the count of every top-k
  expert set, summed over all ranks (each token is routed on exactly one rank), equal - a
  single token routed elsewhere fails, naming the step, the layer and the smallest top-k margin
  (the gap between the k-th and the (k+1)-th router logit) of the step;
* the load-balancing loss of every layer (megatron's MoE metrics, summed over all ranks before
  megatron's own reduction) within 1e-5.

With ``global_aux_loss`` the twin must split the global batch as the CP run does (data-parallel
ranks x micro-batches): megatron defines that loss over each micro-batch's ranks, so two CP=1
layouts with different splits train different losses too (pinned here).

``python -m tests.unit.bridge.test_bridge_families_moe --world 8`` runs the same comparison with
TP2 + sequence parallelism x CP4 on 8 ranks (a manual figure: the table of deviations).
"""

from __future__ import annotations

import argparse
import collections
import math
from typing import Any

import pytest

from tests.unit.bridge._bridge import DECENTRALIZED, HCP, REAL

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only: the "
    "py312 leg runs these (MEGATRON_HCP_STACK=py312)")]

WORLD = 4
RTOL = 1e-5
STEPS = 5

TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
LAYOUTS = {  # expert parallelism and dispatcher: the HCP run and its CP=1 twin share them
    f"ep{ep}_{dispatcher}": [f"model.expert_model_parallel_size={ep}",
                             f"model.moe_token_dispatcher_type={dispatcher}"]
    for ep in (1, 2) for dispatcher in ("alltoall", "allgather")}
GLOBAL_AUX = ["model.moe_router_load_balancing_type=global_aux_loss"]
LOAD_BALANCING = "load_balancing_loss"
# megatron's MoE metrics of the three load-balancing losses (router.py _apply_*aux_loss)
LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


# ------------------------------------------------------------------------------ on each rank
class _RoutingProbe:
    """Forward hooks on every ``TopKRouter`` of the model: per layer, this step's expert counts,
    the count of each top-k expert set, and the smallest top-k margin of its training
    forwards."""

    def __init__(self) -> None:
        self.step: dict[int, dict[str, Any]] = {}

    def attach(self, model: list) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: tuple, output: tuple) -> None:
        import torch

        if not module.training:
            return
        routing_map = output[1].detach().reshape(-1, module.config.num_moe_experts)
        record = self.step.setdefault(module.layer_number, {
            "counts": [0] * routing_map.shape[1], "sets": collections.Counter(),
            "margin": math.inf})
        record["counts"] = [a + int(b) for a, b in zip(record["counts"], routing_map.sum(0))]
        experts = routing_map.nonzero()[:, 1].view(-1, module.topk).tolist()
        record["sets"].update(tuple(sorted(row)) for row in experts)
        with torch.no_grad():
            logits = module.gating(args[0]).reshape(routing_map.shape).float()
            top = logits.topk(module.topk + 1, dim=-1).values
        margin = float((top[:, module.topk - 1] - top[:, module.topk]).min())
        record["margin"] = min(record["margin"], margin)

    def take(self) -> dict[int, dict[str, Any]]:
        step, self.step = self.step, {}
        return step


def _load_balancing_losses() -> dict[str, list[float]]:
    """This rank's load-balancing losses per layer, summed over the step's micro-batches
    (megatron's MoE metrics before their reduction over ranks)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker()._metrics
    return {name: metrics[name].values.tolist() for name in LOSSES if name in metrics}


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Each step's routing and load-balancing losses summed over every rank."""
    steps = []
    for rows in zip(*per_rank):
        routing: dict[int, dict[str, Any]] = {}
        for row in rows:
            for layer, record in row["routing"].items():
                into = routing.setdefault(layer, {"counts": [0] * len(record["counts"]),
                                                  "sets": collections.Counter(),
                                                  "margin": math.inf})
                into["counts"] = [a + b for a, b in zip(into["counts"], record["counts"])]
                into["sets"].update(record["sets"])
                into["margin"] = min(into["margin"], record["margin"])
        losses = {name: [sum(values) for values in zip(*(row["aux"][name] for row in rows))]
                  for name in rows[0]["aux"]}
        steps.append({"routing": routing, "aux": losses})
    return steps


def moe_run(config_dir: str, overrides: list[str], steps: int = STEPS,
            revert: tuple[str, ...] = (), family: str = "qwen3_moe") -> dict:
    """Train the tiny ``family`` recipe (``_families.RECIPES``; Qwen3-MoE unless told) through
    Bridge's ``pretrain`` on this rank; the history gathered over every rank: ``loss``,
    ``grad_norm`` and, per step, ``routing`` and ``aux`` (module docstring). ``revert``:
    megatron-core patches taken off for this run."""
    import torch.distributed as dist

    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment
    from megatron_hcp.patching import apply, by_name
    from megatron_hcp.patching import revert as take_off

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_hcp.bridge.offline import recipe_from_hf_config
    from megatron_hcp.parallel_state.collection import destroy_pg_collection
    from tests.unit.bridge._families import RECIPES, cpu_fp32

    destroy_moe_metrics_tracker()  # nothing left by an earlier run of this process
    probe, rows, kept = _RoutingProbe(), [], {}

    class Record(Callback):
        def on_train_start(self, context):
            kept["pgc"] = get_pg_collection(context.model[0])
            probe.attach(context.model)

        def on_train_step_end(self, context):
            rows.append({"routing": probe.take(), "aux": _load_balancing_losses()})

    cfg = cpu_fp32(recipe_from_hf_config(RECIPES[family], config_dir), train_iters=steps)
    cfg.dist.distributed_backend = "gloo"
    process_config_with_overrides(cfg, cli_overrides=list(overrides) or None)
    recorder = metrics_recorder()
    take_off(by_name(list(revert)))
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, Record()])
    finally:
        apply(by_name(list(revert)))
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)  # this job's own ranks
    return {"loss": recorder.history["loss"], "grad_norm": recorder.history["grad_norm"],
            "steps": _merge(every)}


def moe_failure(config_dir: str, overrides: list[str], revert: tuple[str, ...]) -> str:
    """The failure's text of :func:`moe_run` ('ran' when it trains)."""
    import traceback

    try:
        moe_run(config_dir, overrides, 1, revert)
    except Exception:  # noqa: BLE001 - the failure is the result
        return traceback.format_exc()
    return "ran"


# ------------------------------------------------------------------------------ comparisons
def assert_same_routing(run: dict, base: dict, rtol: float = RTOL) -> None:
    """Every step's routing equal and its load-balancing losses within ``rtol``."""
    assert len(run["steps"]) == len(base["steps"])
    for step, (mine, theirs) in enumerate(zip(run["steps"], base["steps"]), 1):
        assert mine["routing"].keys() == theirs["routing"].keys(), step
        for layer, record in mine["routing"].items():
            other = theirs["routing"][layer]
            margin = min(record["margin"], other["margin"])
            moved = sum(abs(a - b) for a, b in zip(record["counts"], other["counts"])) // 2
            assert record["counts"] == other["counts"] and record["sets"] == other["sets"], (
                f"step {step}, layer {layer}: the routing differs ({moved} expert choices "
                f"moved); smallest top-k margin of the step {margin:.3g}")
        assert mine["aux"].keys() == theirs["aux"].keys(), step
        for name, values in mine["aux"].items():
            for layer, (a, b) in enumerate(zip(values, theirs["aux"][name]), 1):
                assert abs(a - b) <= rtol * abs(b), (name, step, layer, a, b)


def deviations(run: dict, base: dict) -> dict[str, float]:
    """The largest relative deviation of lm loss, grad norm and each load-balancing loss."""
    out = {}
    for key in ("loss", "grad_norm"):
        out[key] = max(abs(a - b) / abs(b) for a, b in zip(run[key], base[key]))
    for name in run["steps"][0]["aux"]:
        out[name] = max(abs(a - b) / abs(b) for mine, theirs in zip(run["steps"], base["steps"])
                        for a, b in zip(mine["aux"][name], theirs["aux"][name]))
    return out


def assert_same(run: dict, base: dict, steps: int = STEPS, rtol: float = RTOL) -> None:
    assert len(run["loss"]) == len(base["loss"]) == steps
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(run[key], base[key]), 1):
            assert math.isfinite(a) and abs(a - b) <= rtol * abs(b), (key, step, a, b)
    assert_same_routing(run, base, rtol)


# ------------------------------------------------------------------------------ the tests
_RUNS: dict = {}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.unit.bridge._families import write_tiny_config

    return str(write_tiny_config("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe")))


def _history(world, config_dir: str, overrides: list[str]) -> dict:
    key = tuple(overrides)
    if key not in _RUNS:
        per_rank = world.run(moe_run, config_dir, overrides, timeout_s=900)
        assert all(h == per_rank[0] for h in per_rank), "ranks disagree on the gathered history"
        _RUNS[key] = per_rank[0]
    return _RUNS[key]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_qwen3_moe_trains_with_hcp_like_its_cp1_twin(world, moe_dir, layout):
    moe = LAYOUTS[layout]
    run = _history(world, moe_dir, [*moe, *HCP, *DECENTRALIZED])
    twin = _history(world, moe_dir, [*moe, *DECENTRALIZED])
    assert_same(run, twin)
    assert all(len(step["routing"]) == 2 for step in run["steps"])  # both layers are MoE
    tokens = 8 * 64 * 2  # global batch x sequence x top-k, per layer and step
    assert all(sum(r["counts"]) == tokens for s in run["steps"] for r in s["routing"].values())


def test_the_cp1_twin_on_the_decentralized_path_equals_bridges_mpu_path(world, moe_dir):
    """The twins run on Bridge's decentralized path (Bridge's own collection: the MoE metrics
    need ``moe-metrics-collection-dp``); the MPU path gives the same run."""
    moe = LAYOUTS["ep1_alltoall"]
    assert_same(_history(world, moe_dir, moe), _history(world, moe_dir, [*moe, *DECENTRALIZED]))


def test_without_the_metrics_patch_the_decentralized_moe_run_fails_in_megatrons_logging(
        world, moe_dir):
    """Bridge 0.6.2's decentralized collection has no ``dp_cp_gtp_remat``; megatron-core
    0.19.2's MoE metrics then ask megatron's global groups, which this path never creates."""
    failures = world.run(moe_failure, moe_dir, [*LAYOUTS["ep1_alltoall"], *DECENTRALIZED],
                         ("moe-metrics-collection-dp",), timeout_s=900)
    for failure in failures:
        assert "data parallel group (with GTP_remat) is not initialized" in failure, (
            failure[-2000:])


def test_the_routing_comparison_fails_on_one_token_routed_elsewhere(world, moe_dir):
    """The comparison is shown to fail: one token of step 3's first layer moved from one expert
    to another (its expert set changed), counts and sets both."""
    import copy

    moe = LAYOUTS["ep1_alltoall"]
    base = _history(world, moe_dir, [*moe, *DECENTRALIZED])
    run = copy.deepcopy(base)
    record = run["steps"][2]["routing"][1]
    before = next(s for s, n in record["sets"].items() if n)
    after = tuple(sorted({*before[1:], next(e for e in range(8) if e not in before)}))
    record["sets"][before] -= 1
    record["sets"][after] += 1
    record["counts"][before[0]] -= 1
    record["counts"][(set(after) - set(before)).pop()] += 1
    with pytest.raises(AssertionError, match="step 3, layer 1: the routing differs"):
        assert_same_routing(run, base)
    run = copy.deepcopy(base)
    run["steps"][4]["aux"][LOAD_BALANCING][1] *= 1 + 3 * RTOL
    with pytest.raises(AssertionError, match=LOAD_BALANCING):
        assert_same_routing(run, base)


def test_the_global_aux_loss_follows_the_batch_split_not_cp(world, moe_dir):
    """megatron's ``global_aux_loss`` (router.py:504-548) averages, over the step's micro-batches
    so far, token counts all-reduced over TP x DP x CP at each micro-batch: its value depends on
    how the global batch is split into data-parallel ranks and micro-batches, which CP changes
    (CP ranks share each sequence; the CP=1 twin's are data-parallel ranks with sequences of
    their own). CP2 x DP2 trains like TP2+SP x DP2 (one split: 2 sequences a micro-batch over
    the group, 4 micro-batches); DP4 (4 sequences, 2 micro-batches) trains another loss, as
    CP4 (1 sequence, 8) does: with it a CP run is compared with a twin of the same split."""
    moe = [*LAYOUTS["ep1_alltoall"], *GLOBAL_AUX, *DECENTRALIZED]
    cp2 = _history(world, moe_dir, [*moe, "model.context_parallel_size=2"])
    tp2 = _history(world, moe_dir, [*moe, *TP2])
    assert_same(cp2, tp2)
    assert "global_load_balancing_loss" in cp2["steps"][0]["aux"]
    assert deviations(_history(world, moe_dir, moe), tp2)["grad_norm"] > RTOL


# ------------------------------------------------------------------------------ manual figure
def main() -> None:
    """The table of deviations of every layout from its CP=1 twin (``--world 8``: TP2 + SP x
    CP4 [2,2], one run of 8 ranks at a time)."""
    import tempfile

    from megatron_hcp.harness.local_world import LocalWorld
    from tests.unit.bridge._families import write_tiny_config

    parser = argparse.ArgumentParser(description="Qwen3-MoE HCP vs CP=1 through Bridge's loop")
    parser.add_argument("--world", type=int, choices=(4, 8), default=8)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    extra = TP2 if args.world == 8 else []
    with tempfile.TemporaryDirectory() as tmp, LocalWorld(args.world).start() as world:
        config_dir = str(write_tiny_config("qwen3_moe", f"{tmp}/qwen3-moe"))
        for name, moe in sorted(LAYOUTS.items()):
            runs = [world.run(moe_run, config_dir, [*extra, *moe, *cp, *DECENTRALIZED],
                              args.steps, timeout_s=1800)[0] for cp in (HCP, [])]
            figures = deviations(*runs)
            try:
                assert_same(*runs, steps=args.steps)
                verdict = "equal"
            except AssertionError as err:
                verdict = f"DIFFERS: {err}"
            print(f"{'TP2+SP x ' if extra else ''}CP4 a2a+p2p [2,2] {name}: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in figures.items()) + f" - {verdict}",
                  flush=True)


if __name__ == "__main__":
    main()
