"""One rank of a functional recipe run (started by torchrun; see ``harness.run_recipe``).

``python -m megatron_hcp.functional.worker RECIPE_DIR --out FILE [--steps N] [--cp1]
[--checkpoint-dir D --save-at K | --resume-from K] [--platform cpu_gloo]``: rank 0 writes
the metrics as JSON. Only ``cpu_gloo`` (gloo) is supported: the trainer keeps model and batches
on the CPU, so NCCL could not carry its tensors (``gpu_nccl`` is refused, naming this).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys


def _metrics(history: dict, first_step: int) -> dict:
    """Per-step metrics keyed like megatron's (steps numbered from 1)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps = range(first_step + 1, first_step + 1 + len(history["loss"]))
    return {
        "lm loss": dict(zip(steps, history["loss"])),
        "num-zeros": dict(zip(steps, history["num_zeros"])),
        "iteration-time": dict(zip(steps, history["iteration_time"])),
        # CPU: peak resident memory of rank 0 (megatron reports CUDA bytes allocated)
        "mem-allocated-bytes": dict(zip(steps, [float(rss)] * len(history["loss"]))),
        "grad norm": dict(zip(steps, history["grad_norm"])),
        "micro-batches": dict(zip(steps, history["micro_batches"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--cp1", action="store_true")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-at", type=int, action="append", default=[])
    parser.add_argument("--resume-from", type=int)
    parser.add_argument("--platform", default="cpu_gloo")
    opts = parser.parse_args(argv)

    import dataclasses

    import torch.distributed as dist

    from ..patching import (
        DECENTRALIZED_PATCHES,
        apply,
        apply_cpu_runtime,
        apply_dynamic_cp,
        by_name,
    )
    from ..training.trainer import train_tiny_gpt
    from .recipe import load_recipe

    recipe = load_recipe(opts.recipe)
    if opts.cp1:
        recipe = recipe.with_cp1()
    spec = dataclasses.replace(
        recipe.spec, steps=opts.steps or recipe.spec.steps, checkpoint_dir=opts.checkpoint_dir,
        save_at_steps=tuple(opts.save_at), resume_from_step=opts.resume_from)
    from .launch import BACKENDS, require_runnable

    require_runnable(opts.platform)
    dist.init_process_group(BACKENDS[opts.platform])
    apply_cpu_runtime()
    apply_dynamic_cp()
    rank = dist.get_rank()

    def progress(step: int, history: dict) -> None:
        if rank == 0:
            print(f"[{recipe.name}] step {step + 1}/{spec.steps} | lm loss "
                  f"{history['loss'][-1]:.6f} | grad norm {history['grad_norm'][-1]:.4f} | "
                  f"micro-batches {history['micro_batches'][-1]} | "
                  f"{history['iteration_time'][-1]:.2f} s", flush=True)

    try:
        if recipe.decentralized:
            from ..parallel_state.collection import create_pg_collection, destroy_pg_collection

            apply(by_name(list(DECENTRALIZED_PATCHES)))
            pgc = create_pg_collection(recipe.config)
            try:
                history = train_tiny_gpt(spec, pg_collection=pgc, on_step=progress)
            finally:
                destroy_pg_collection(pgc)
        else:
            from ..parallel_state.mpu import destroy_model_parallel, initialize_model_parallel

            vpp = spec.virtual_pipeline_model_parallel_size
            initialize_model_parallel(
                recipe.config, create_gloo_process_groups=False,
                **({"virtual_pipeline_model_parallel_size": vpp} if vpp else {}))
            try:
                history = train_tiny_gpt(spec, on_step=progress)
            finally:
                destroy_model_parallel()
        if rank == 0:
            with open(opts.out, "w", encoding="utf-8") as fh:
                json.dump(_metrics(history, opts.resume_from or 0), fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
