"""A whole training step's memory per rank through Megatron-Bridge's own loop, without a GPU.

Bridge's ``pretrain()`` of the project's tiny Llama recipe (``tiny_llama_pretrain_config``:
Bridge's pretrain base, mock GPT data, RMSNorm, SwiGLU, GQA) at a fixed global sequence, on
``--world`` local gloo ranks (DP = world / CP), CP 1 to 8, fp32 (the CPU run): the bytes its
``forward_backward`` holds when its first backward starts (the activations: weights, gradient
buffers and optimizer states exist before and are not counted) and its peak, of the second of
two steps, counted by :class:`megatron_hcp.attention.reference.memory.LiveBytes` around the
schedule Bridge's loop takes (``training.train.get_forward_backward_func``, the hook's dynamic-CP
wrapper included). Run from the repository root on the py312 stack:

    .venv-py312/bin/python benchmarks/bridge_memory.py --world 8 --cp 1 2 4 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_hcp.functional.bridge_memory import bridge_step_memory  # noqa: E402
from megatron_hcp.harness.local_world import LocalWorld  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--comm", default="p2p")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--world", type=int, default=4, help="ranks (DP = world / CP)")
    args = parser.parse_args(argv)
    shape = (args.comm, args.seq, args.hidden, args.layers, args.heads)
    print(f"Bridge's pretrain, tiny Llama, S={args.seq}, hidden {args.hidden}, {args.layers} "
          f"layers, {args.heads} heads, fp32, {args.comm}, {args.world} gloo ranks "
          f"(DP = {args.world} / CP)")
    head = f"{'CP':>3} {'act MiB':>8} {'x CP':>6} {'peak MiB':>9} {'x CP':>6}"
    print(head)
    print("-" * len(head))
    base = None
    mib = 2.0**20
    for cp in args.cp:
        with LocalWorld(args.world, timeout_s=1800, daemon=False) as world:
            per_rank = world.run(bridge_step_memory, cp, *shape, timeout_s=1800)
        layouts = {tuple(map(str, r["layout"])) for r in per_rank}
        assert len(layouts) == 1 and next(iter(layouts))[0] == str(cp), layouts
        act = max(r["activations"] for r in per_rank)
        peak = max(r["peak"] for r in per_rank)
        base = base or (act * cp, peak * cp)
        print(f"{cp:>3} {act / mib:8.2f} {act * cp / base[0]:6.3f} {peak / mib:9.2f} "
              f"{peak * cp / base[1]:6.3f}   (the run's layout: {', '.join(next(iter(layouts)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
