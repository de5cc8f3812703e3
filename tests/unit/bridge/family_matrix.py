"""Every model family through Megatron-Bridge's own ``pretrain()`` with HCP against its CP=1 twin:
one command, one table.

    python -m tests.unit.bridge.family_matrix [--world 8] [--steps 5] [--families gemma3 ...]

Each family is Bridge 0.6.2's own recipe function - run offline from a tiny ``transformers``
config, or called as it is and shrunk where it builds its provider itself (Gemma 3, Nemotron-H) -
made a CPU fp32 run on mock data
(:func:`megatron_hcp.bridge.family_recipes.tiny_family_pretrain_config`). ``--world 8``: TP2 with
sequence parallelism x CP4 ``a2a+p2p`` [2,2] on Bridge's decentralized path and on the MPU path,
each against the TP2+SP CP=1 twin (the CP ranks data-parallel); ``--world 4``: CP4 [2,2]
without TP. MoE families run with expert parallelism 2 and the alltoall dispatcher. Prints one
Markdown row per family and path (largest relative deviation of lm loss and grad norm over the
steps, the verdict at 1e-5), headed by the date, the commit and the machine. The CI tests run
the cheapest layout of each family (``test_bridge_families_*.py``, ``test_bridge_family_*.py``).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
from pathlib import Path

from tests.unit.bridge._bridge import DECENTRALIZED, HCP

RTOL = 1e-5
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3", "nemotron_h")
MOE = {"qwen3_moe", "deepseek_v3", "gpt_oss"}
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
EP2 = ["model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"]


def matrix_run(family: str, overrides: list[str], steps: int) -> dict:
    """Train ``family`` through Bridge's ``pretrain`` on this rank; loss and grad norm per step."""
    from megatron_hcp.bridge.run import metrics_recorder, prepare_environment

    prepare_environment(cpu=True)
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_hcp.bridge.family_recipes import tiny_family_pretrain_config
    from megatron_hcp.parallel_state.collection import destroy_pg_collection

    kept: dict = {}

    class KeepCollection(Callback):  # Bridge never destroys a decentralized collection
        def on_train_start(self, context):
            kept["pgc"] = get_pg_collection(context.model[0])

    destroy_moe_metrics_tracker()
    cfg = tiny_family_pretrain_config(family, train_iters=steps)  # its config in memory
    cfg.dist.distributed_backend = "gloo"
    process_config_with_overrides(cfg, cli_overrides=list(overrides) or None)
    recorder = metrics_recorder()
    try:
        pretrain(cfg, forward_step, callbacks=[recorder, KeepCollection()])
    finally:
        if cfg.dist.use_decentralized_pg and "pgc" in kept:
            destroy_pg_collection(kept["pgc"])
    return {"loss": recorder.history["loss"], "grad_norm": recorder.history["grad_norm"]}


def deviation(run: dict, twin: dict) -> tuple[float, float]:
    return tuple(max(abs(a - b) / abs(b) for a, b in zip(run[key], twin[key]))
                 for key in ("loss", "grad_norm"))


def _header(world: int, steps: int) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    layout = ("TP2+SP x CP4 a2a+p2p [2,2]" if world == 8 else "CP4 a2a+p2p [2,2]")
    return (f"{datetime.date.today()}, commit {commit}, {platform.machine()} CPU "
            f"({platform.processor() or 'unknown'}), {world} gloo ranks, {layout} vs CP=1, "
            f"{steps} steps, fp32\n\n| family | path | loss | grad norm | equal at {RTOL:g} |\n"
            "|---|---|---|---|---|")


def main() -> None:
    from megatron_hcp.harness.local_world import LocalWorld

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=(4, 8), default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    args = parser.parse_args()
    base = TP2 if args.world == 8 else []
    print(_header(args.world, args.steps), flush=True)
    with LocalWorld(args.world).start() as world:
        for family in args.families:
            extra = [*base, *(EP2 if family in MOE else [])]
            twin = None
            for path, overrides in (("decentralized", DECENTRALIZED), ("MPU", [])):
                try:
                    if twin is None:
                        twin = world.run(matrix_run, family, [*extra, *DECENTRALIZED],
                                         args.steps, timeout_s=1800)[0]
                    run = world.run(matrix_run, family, [*extra, *HCP, *overrides],
                                    args.steps, timeout_s=1800)[0]
                except Exception as err:  # noqa: BLE001 - a family that fails is a row too
                    print(f"| {family} | {path} | - | - | FAILED: "
                          f"{str(err).strip().splitlines()[-1][:160]} |", flush=True)
                    continue
                loss, grad = deviation(run, twin)
                verdict = "yes" if max(loss, grad) <= RTOL else "NO"
                print(f"| {family} | {path} | {loss:.1e} | {grad:.1e} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
