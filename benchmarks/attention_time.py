"""CP attention time per step, against one flash call on the rank's own tokens.

The cases of ``benchmarks/attention_memory.py`` (comm types x bshd / thd x MHA, GQA, MLA head
dims, a window of S/8; CP 2, 4, 8), timed on local gloo ranks, one thread each (CPU, fp32,
causal, batch 1): one forward and backward of the CP step from a barrier to a barrier (its
slowest rank), best of ``--repeats`` after a warm-up, against
:class:`~megatron_hcp.attention.reference.memory_proxy.LocalFlash` on the same rank's tokens in
the same run (the slowest rank's). Where a change trades memory, this is its cost in time: run
it at both commits.

``.venv/bin/python benchmarks/attention_time.py [--seq 4096] [--cp 4] [--comms ...]
[--formats bshd thd] [--variants mha gqa mla window] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_memory import COMMS, VARIANTS, cases_for  # noqa: E402

from megatron_hcp.attention.reference.memory_proxy import rank_times  # noqa: E402
from megatron_hcp.harness.local_world import LocalWorld  # noqa: E402
from megatron_hcp.parallel_state.groups import bare_cp_groups  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[4])
    parser.add_argument("--comms", nargs="+", default=list(COMMS), choices=COMMS)
    parser.add_argument("--formats", nargs="+", default=["bshd", "thd"], choices=["bshd", "thd"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sequences", type=int, default=4, help="thd: packed sequences")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"CP attention step time (forward + backward), S={args.seq}, fp32, causal, batch 1, "
          f"one thread a rank; torch {torch.__version__}")
    print(f"{'CP':>3} {'case':<28} {'step ms':>9} {'flash ms':>9} {'ratio':>7}")
    for cp in args.cp:
        cases = cases_for(cp, args.seq, args.comms, args.formats, args.variants, args.sequences)
        with LocalWorld(cp, timeout_s=3000, env={"OMP_NUM_THREADS": "1"}) as world:
            per_rank = world.run(rank_times, tuple(cases), args.repeats,
                                 cp_groups=bare_cp_groups, timeout_s=3000)
        for i, case in enumerate(cases):
            step = max(ranks[i][0] for ranks in per_rank)
            flash = max(ranks[i][1] for ranks in per_rank)
            print(f"{cp:>3} {case.name:<28} {step * 1e3:9.1f} {flash * 1e3:9.1f} "
                  f"{step / flash:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
