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


def _base_checkpoint(recipe: Any, work_dir: str, pretrain: Any, forward_step: Any,
                     platform: str) -> str:
    """A pretrained checkpoint for ``finetune``: the same model pre-trained one step with CP=1
    (the recipe and its CP=1 twin start from the same weights)."""
    base_dir = os.path.join(work_dir, "pretrained")
    base = recipe.with_cp1().build(steps=1, work_dir=work_dir, platform=platform)
    base.checkpoint.save = base_dir
    base.checkpoint.save_interval = 1
    pretrain(base, forward_step)
    return base_dir


def train_bridge_recipe(recipe: Any, platform: str, work_dir: str, *, steps: int | None = None,
                        checkpoint_dir: str | None = None, save_at: list[int] | None = None,
                        resume_from: int | None = None, base: Any = None,
                        progress: Any = None) -> dict[str, list]:
    """Train ``recipe`` with Bridge's own ``pretrain`` / ``finetune`` in this initialized world
    as every rank of it does on ``platform`` (after
    :func:`~megatron_hcp.bridge.run.prepare_environment`); ``base``: the recipe whose CP=1 twin
    pre-trains a finetune's checkpoint (default ``recipe``). Returns the merged history."""
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from ..bridge.run import metrics_recorder

    entry = finetune if recipe.entry == "finetune" else pretrain
    cfg = recipe.build(steps=steps, work_dir=work_dir, platform=platform)
    if recipe.entry == "finetune" and cfg.checkpoint.pretrained_checkpoint is None:
        cfg.checkpoint.pretrained_checkpoint = _base_checkpoint(
            base or recipe, work_dir, pretrain, forward_step, platform)
    if save_at:
        cfg.checkpoint.save = checkpoint_dir
        cfg.checkpoint.save_interval = min(save_at)
    if resume_from is not None:
        cfg.checkpoint.load = checkpoint_dir
        cfg.checkpoint.ckpt_step = resume_from
    recorder = metrics_recorder(progress)
    entry(cfg, forward_step, callbacks=[recorder])
    return recorder.history


def _parser() -> Any:
    parser = worker_parser()
    parser.add_argument("--work-dir", required=True)  # generated data, the base checkpoint
    return parser


def prefork(argv: list[str]) -> None:
    """Once before the ranks are forked (``--launcher forkserver``): Bridge's imports, stand-ins
    and patches, which each rank's :func:`main` would otherwise repeat (15 CPU-s a rank)."""
    if _parser().parse_args(argv).platform == "cpu_gloo":
        from ..bridge.run import prepare_environment

        prepare_environment(cpu=True)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)

    import torch.distributed as dist

    from ..bridge.run import prepare_environment
    from .launch import init_rank_process_group, require_runnable
    from .recipe import load_recipe

    allowed = {"allow_env": opts.allow_env, "allow_recipe_modules": opts.allow_recipe_module}
    recipe = load_recipe(opts.recipe, **allowed)
    if opts.cp1:
        recipe = recipe.with_cp1()
    require_runnable(opts.platform)
    gpu = opts.platform == "gpu_nccl"
    if gpu:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    prepare_environment(cpu=not gpu)
    # the process group is this worker's: Bridge runs inside it and leaves it (several runs)
    init_rank_process_group(opts.platform)
    try:
        total = opts.steps or recipe.steps

        def progress(step: int, row: dict) -> None:
            step += opts.resume_from or 0
            print(f"[{recipe.name}] step {step}/{total} | lm loss {row['loss']:.6f} | grad norm "
                  f"{row['grad_norm']:.4f} | micro-batches {row['micro_batches']} | "
                  f"{row['iteration_time']:.2f} s", flush=True)

        history = train_bridge_recipe(
            recipe, opts.platform, opts.work_dir, steps=opts.steps,
            checkpoint_dir=opts.checkpoint_dir, save_at=opts.save_at,
            resume_from=opts.resume_from, base=load_recipe(opts.recipe, **allowed),
            progress=progress)
        if dist.get_rank() == 0:
            with open(opts.out, "w", encoding="utf-8") as fh:
                json.dump(_metrics(history, opts.resume_from or 0), fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
