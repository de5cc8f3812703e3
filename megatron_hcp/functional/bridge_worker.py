"""One rank of a Bridge recipe run (started by torchrun; see ``functional.harness.run_recipe``).

``python -m megatron_hcp.functional.bridge_worker RECIPE_DIR --out FILE --work-dir DIR [--steps N]
[--cp1] [--checkpoint-dir D --save-at K | --resume-from K] [--platform cpu_gloo]``: builds the
recipe's Bridge ``ConfigContainer`` and trains it with Bridge's own ``pretrain`` / ``finetune``
and ``gpt_step.forward_step`` (after :func:`megatron_hcp.bridge.run.prepare_environment`);
rank 0 writes the per-step metrics as JSON, keyed like megatron's golden values. Checkpoints
are Bridge's own (``torch_dist``): saved every K steps into D, resumed from step K.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

from .worker import worker_parser


def _metrics(history: dict[str, list], first_step: int) -> dict:
    rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    steps = list(range(first_step + 1, first_step + 1 + len(history["loss"])))

    def series(values: list) -> dict[int, float]:
        return {s: float(v) for s, v in zip(steps, values) if v is not None}

    dynamic = history["dynamic_cp"]
    out = {
        "lm loss": series(history["loss"]),
        "num-zeros": series(history["num_zeros"]),
        "iteration-time": series(history["iteration_time"]),
        "mem-allocated-bytes": series([rss] * len(steps)),
        "grad norm": series(history["grad_norm"]),
        "micro-batches": series(history["micro_batches"]),
    }
    if any(d is not None for d in dynamic):
        out["max-cp-group-size"] = series([max(d["group_sizes"]) for d in dynamic])
        out["hierarchical-cp-groups"] = series([d["hierarchical_groups"] for d in dynamic])
    return out


def _base_checkpoint(recipe: Any, work_dir: str, pretrain: Any, forward_step: Any) -> str:
    """A pretrained checkpoint for ``finetune``: the same model pre-trained one step with CP=1
    (the recipe and its CP=1 twin start from the same weights)."""
    base_dir = os.path.join(work_dir, "pretrained")
    base = recipe.with_cp1().build(steps=1, work_dir=work_dir)
    base.checkpoint.save = base_dir
    base.checkpoint.save_interval = 1
    pretrain(base, forward_step)
    return base_dir


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser()
    parser.add_argument("--work-dir", required=True)  # generated data, the base checkpoint
    opts = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from ..bridge.run import metrics_recorder, prepare_environment
    from .launch import BACKENDS, require_runnable
    from .recipe import load_recipe

    recipe = load_recipe(opts.recipe)
    if opts.cp1:
        recipe = recipe.with_cp1()
    require_runnable(opts.platform)
    gpu = opts.platform == "gpu_nccl"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    prepare_environment(cpu=not gpu)
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    entry = finetune if recipe.entry == "finetune" else pretrain
    # the process group is this worker's: Bridge runs inside it and leaves it (several runs)
    dist.init_process_group(BACKENDS[opts.platform])
    try:
        cfg = recipe.build(steps=opts.steps, work_dir=opts.work_dir)
        if recipe.entry == "finetune" and cfg.checkpoint.pretrained_checkpoint is None:
            cfg.checkpoint.pretrained_checkpoint = _base_checkpoint(
                load_recipe(opts.recipe), opts.work_dir, pretrain, forward_step)
        if opts.save_at:
            cfg.checkpoint.save = opts.checkpoint_dir
            cfg.checkpoint.save_interval = min(opts.save_at)
        if opts.resume_from is not None:
            cfg.checkpoint.load = opts.checkpoint_dir
            cfg.checkpoint.ckpt_step = opts.resume_from
        total = cfg.train.train_iters

        def progress(step: int, row: dict) -> None:
            step += opts.resume_from or 0
            print(f"[{recipe.name}] step {step}/{total} | lm loss {row['loss']:.6f} | grad norm "
                  f"{row['grad_norm']:.4f} | micro-batches {row['micro_batches']} | "
                  f"{row['iteration_time']:.2f} s", flush=True)

        recorder = metrics_recorder(progress)
        entry(cfg, forward_step, callbacks=[recorder])
        if dist.get_rank() == 0:
            with open(opts.out, "w", encoding="utf-8") as fh:
                json.dump(_metrics(recorder.history, opts.resume_from or 0), fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
