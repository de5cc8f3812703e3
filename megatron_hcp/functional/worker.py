"""One rank of a functional recipe run (started by torchrun; see ``harness.run_recipe``).

``python -m megatron_hcp.functional.worker RECIPE_DIR --out FILE [--steps N] [--cp1]
[--checkpoint-dir D --save-at K | --resume-from K] [--platform cpu_gloo]``: rank 0 writes
the metrics as JSON. ``cpu_gloo``: gloo, model and batches on the CPU, the CPU runtime patches,
the reference CP attention. ``gpu_nccl``: NCCL, each rank on GPU ``LOCAL_RANK``, and the
attention backend ``auto`` (Transformer Engine where it imports, else the reference backend on
the GPU). Only ``cpu_gloo`` has run here (no GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from typing import Any

from .allowances import add_arguments


def _cp_group_metrics(histories: list[dict]) -> dict[str, list[float]]:
    """Per step, over every rank's dynamic-CP record: the largest CP group any micro-batch
    used and how many hierarchical (a2a x p2p) groups ran. Empty without dynamic CP."""
    steps = len(histories[0].get("local_cp_sizes", []))
    if not any(s is not None for h in histories for step in h["local_cp_sizes"] for s in step):
        return {}
    largest, hierarchical = [], []
    for step in range(steps):
        sizes = [s or 1 for h in histories for s in h["local_cp_sizes"][step]]
        largest.append(float(max(sizes, default=1)))
        # each group is seen by each of its ranks: count a rank as 1/size of its group
        hierarchical.append(float(round(sum(
            1 / (s or 1) for h in histories
            for s, lv in zip(h["local_cp_sizes"][step], h["cp_levels"][step]) if lv))))
    return {"max-cp-group-size": largest, "hierarchical-cp-groups": hierarchical}


def _metrics(history: dict, first_step: int, histories: list[dict]) -> dict:
    """Per-step metrics keyed like megatron's (steps numbered from 1); ``histories``: every
    rank's history, for the dynamic-CP group metrics."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps = range(first_step + 1, first_step + 1 + len(history["loss"]))
    groups = {name: dict(zip(steps, values))
              for name, values in _cp_group_metrics(histories).items()}
    return {
        "lm loss": dict(zip(steps, history["loss"])),
        "num-zeros": dict(zip(steps, history["num_zeros"])),
        "iteration-time": dict(zip(steps, history["iteration_time"])),
        # CPU: peak resident memory of rank 0 (megatron reports CUDA bytes allocated)
        "mem-allocated-bytes": dict(zip(steps, [float(rss)] * len(history["loss"]))),
        "grad norm": dict(zip(steps, history["grad_norm"])),
        "micro-batches": dict(zip(steps, history["micro_batches"])),
        **groups,
    }


def worker_parser() -> argparse.ArgumentParser:
    """The command line of a recipe's worker (this one and Bridge's), as
    ``harness.run_recipe`` builds it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--cp1", action="store_true")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-at", type=int, action="append", default=[])
    parser.add_argument("--resume-from", type=int)
    parser.add_argument("--platform", default="cpu_gloo")
    add_arguments(parser)  # what the caller allowed the recipe, as the launcher read it
    return parser


def platform_spec(recipe: Any, platform: str, **overrides: Any) -> Any:
    """The recipe's spec as ``platform`` runs it: ``gpu_nccl`` trains on this rank's current
    CUDA device with the attention backend ``auto`` (TE where it imports, else the reference
    backend on the GPU); ``cpu_gloo`` on the CPU with the reference backend."""
    import dataclasses

    gpu = {"device": "cuda", "attention_backend": "auto"} if platform == "gpu_nccl" else {}
    return dataclasses.replace(recipe.spec, **gpu, **overrides)


def train_recipe(recipe: Any, spec: Any, platform: str, on_step: Any = None) -> dict:
    """Train ``spec`` in this initialized world as every rank of ``recipe`` does: the patches of
    ``platform`` (the CPU runtime on ``cpu_gloo`` only, whatever the machine has; TE's HCP patch
    on ``gpu_nccl`` where TE imports), the recipe's groups (MPU path or decentralized
    collection), megatron's schedule; returns this rank's history."""
    from ..patching import (
        DECENTRALIZED_PATCHES,
        apply,
        apply_cpu_runtime,
        apply_dynamic_cp,
        by_name,
    )
    from ..training.trainer import train_tiny_gpt

    if platform == "cpu_gloo":
        apply_cpu_runtime()
    apply_dynamic_cp()
    if recipe.config.cp_partition_mode != "zigzag":
        apply(by_name(["rope-cp-partition-mode"]))
    if platform == "gpu_nccl":
        from ..attention.te import have_te

        if have_te():  # TEDotProductAttention takes its CP groups from resolve_cp_groups
            apply(by_name(["te-attention-hcp"]))
    if recipe.decentralized:
        from ..parallel_state.collection import create_pg_collection, destroy_pg_collection

        apply(by_name(list(DECENTRALIZED_PATCHES)))
        pgc = create_pg_collection(recipe.config)
        try:
            return train_tiny_gpt(spec, pg_collection=pgc, on_step=on_step)
        finally:
            destroy_pg_collection(pgc)
    from ..parallel_state.mpu import destroy_model_parallel, initialize_model_parallel

    vpp = spec.virtual_pipeline_model_parallel_size
    initialize_model_parallel(recipe.config, create_gloo_process_groups=False,
                             **({"virtual_pipeline_model_parallel_size": vpp} if vpp else {}))
    try:
        return train_tiny_gpt(spec, on_step=on_step)
    finally:
        destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    opts = worker_parser().parse_args(argv)

    import torch.distributed as dist

    from .launch import init_rank_process_group, require_runnable
    from .recipe import load_recipe

    recipe = load_recipe(opts.recipe, allow_env=opts.allow_env,
                         allow_recipe_modules=opts.allow_recipe_module)
    if opts.cp1:
        recipe = recipe.with_cp1()
    require_runnable(opts.platform)
    spec = platform_spec(
        recipe, opts.platform, steps=opts.steps or recipe.spec.steps,
        checkpoint_dir=opts.checkpoint_dir, save_at_steps=tuple(opts.save_at),
        resume_from_step=opts.resume_from)
    if opts.platform == "gpu_nccl":
        import os

        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_rank_process_group(opts.platform)
    rank = dist.get_rank()

    def progress(step: int, history: dict) -> None:
        if rank == 0:
            print(f"[{recipe.name}] step {step + 1}/{spec.steps} | lm loss "
                  f"{history['loss'][-1]:.6f} | grad norm {history['grad_norm'][-1]:.4f} | "
                  f"micro-batches {history['micro_batches'][-1]} | "
                  f"{history['iteration_time'][-1]:.2f} s", flush=True)

    try:
        history = train_recipe(recipe, spec, opts.platform, on_step=progress)
        record = {k: history.get(k, []) for k in ("local_cp_sizes", "cp_levels")}
        histories: list = [None] * dist.get_world_size()
        dist.all_gather_object(histories, record)  # trusted: this job's own ranks
        if rank == 0:
            with open(opts.out, "w", encoding="utf-8") as fh:
                json.dump(_metrics(history, opts.resume_from or 0, histories), fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
