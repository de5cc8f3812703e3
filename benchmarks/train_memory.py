"""Activation memory per rank of a whole training step, measured without a GPU, against the
planner's memory model.

The project's trainer (``megatron_hcp.training.trainer.train_tiny_gpt``: megatron's GPT, its
forward-backward schedule, DDP and optimizer) on 4 gloo ranks, CP 1, 2 and 4 (DP 4, 2, 1) for
one fixed global sequence, one micro-batch of one sequence per DP rank, fp32. The step's
``forward_backward`` runs under :class:`~megatron_hcp.attention.reference.memory.LiveBytes`:
what it allocates and still holds when the backward starts is the step's activations (the
weights, gradient buffers and optimizer states exist before it and are not counted); the peak
over forward and backward beside it. Per rank x CP should not depend on CP (each rank holds
S/CP tokens of every activation). Beside them the planner's ``memory_per_gpu`` for the same
layout (``functional.preflight.recipe_memory``: selective recompute, activations and logits
at fp32 - the planner counts bf16 activations, FP32_SCALE 2): its layers' activations and
logits (what lives from forward to backward) against the measured activations, and its
whole activation term (with the working and CP buffers of the layer being computed) against
the measured peak.

``.venv/bin/python benchmarks/train_memory.py [--seq 2048] [--hidden 256] [--layers 2]``
"""

from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.harness.local_world import LocalWorld  # noqa: E402

WORLD = 4  # ranks (DP = WORLD / CP); --world 8 reaches CP 8


def _spec(cp: int, comm: str, seq: int, hidden: int, layers: int, heads: int,
          world: int = WORLD):
    from megatron_hcp.training.trainer import TinyGPTSpec

    return TinyGPTSpec.of(num_layers=layers, num_attention_heads=heads,
                          num_query_groups=heads, seq_length=seq, hidden_size=hidden,
                          context_parallel_size=cp, cp_comm_type=comm, micro_batch_size=1,
                          global_batch_size=world // cp, steps=2,
                          max_position_embeddings=seq)


def rank_step_memory(cp: int, comm: str, seq: int, hidden: int, layers: int, heads: int
                     ) -> dict[str, int]:
    """On this rank: the bytes a training step's forward_backward holds when its backward
    starts (the activations) and its peak, of the last of two steps."""
    import megatron.core.pipeline_parallel as pipeline
    import torch.distributed as dist

    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply_cpu_runtime
    from megatron_hcp.training.step_memory import counted_schedules
    from megatron_hcp.training.trainer import train_tiny_gpt

    apply_cpu_runtime()
    world = dist.get_world_size()
    initialize_model_parallel(
        CPConfig(context_parallel_size=cp, data_parallel_size=world // cp, cp_comm_type=comm,
                 num_attention_heads=heads, num_query_groups=heads, seq_length=seq),
        create_gloo_process_groups=False)
    with counted_schedules(pipeline) as seen:
        try:
            train_tiny_gpt(_spec(cp, comm, seq, hidden, layers, heads, world))
        finally:
            destroy_model_parallel()
    return dict(seen)


def planner_bytes(cp: int, comm: str, seq: int, hidden: int, layers: int, heads: int,
                  world: int = WORLD) -> dict[str, float]:
    """The planner's memory model for the same run at fp32, as the harness checks a recipe
    (``recipe_memory``), and its part that lives from the forward to the backward: the
    layers' activations per token (``_activation_bytes_per_token``) and the logits, without
    the working and CP buffers of the layer being computed."""
    from megatron_hcp.functional.preflight import FP32_SCALE, recipe_memory
    from megatron_hcp.planner.estimate import _activation_bytes_per_token
    from megatron_hcp.planner.inputs import ModelSpec

    spec = _spec(cp, comm, seq, hidden, layers, heads, world)
    memory = recipe_memory(types.SimpleNamespace(spec=spec))
    model = ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_query_groups=heads, vocab_size=spec.vocab_size, untie_embeddings=True)
    tokens = seq // cp
    kept = layers * _activation_bytes_per_token(model, 1) * tokens * FP32_SCALE
    return {"total": memory["activations"] + memory["logits"],
            "kept": kept + memory["logits"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--comm", default="p2p")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--world", type=int, default=WORLD, help="ranks (DP = world / CP)")
    args = parser.parse_args(argv)
    shape = (args.comm, args.seq, args.hidden, args.layers, args.heads)
    print(f"training step, S={args.seq}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads, fp32, {args.comm}, {args.world} gloo ranks "
          f"(DP = {args.world} / CP)")
    head = (f"{'CP':>3} {'act MiB':>8} {'x CP':>6} {'planner kept':>12} {'ratio':>6} "
            f"{'peak MiB':>9} {'planner':>8} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    base = None
    for cp in args.cp:
        with LocalWorld(args.world, timeout_s=1800) as world:
            per_rank = world.run(rank_step_memory, cp, *shape, timeout_s=1800)
        act = max(r["activations"] for r in per_rank)
        peak = max(r["peak"] for r in per_rank)
        plan = planner_bytes(cp, *shape, args.world)
        base = base or act * cp
        mib = 2.0**20
        print(f"{cp:>3} {act / mib:8.2f} {act * cp / base:6.3f} {plan['kept'] / mib:12.2f} "
              f"{act / plan['kept']:6.3f} {peak / mib:9.2f} {plan['total'] / mib:8.2f} "
              f"{peak / plan['total']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
