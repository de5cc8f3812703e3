"""Layout planner: the Megatron-Bridge HCP page's example under varied assumptions.

The page (8 KV heads, 4 nodes x 8 GPUs, 128K sequences) prefers B = TP2 CP4 a2a over
A = TP1 CP16 a2a+p2p [8,2] over C = TP1 CP16 p2p. The planner reproduces that with its default
constants (``tests/unit/planner/test_plan.py``); this script shows how far the ordering holds when
the uncalibrated constants move: inter-node bandwidth, achieved TFLOP/s, global batch and TP
communication overlap. Model: the Llama-3-8B shape (the page names none).

Run: ``.venv/bin/python benchmarks/plan.py``
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.planner import Batch, Cluster, ModelSpec, Options, plan  # noqa: E402

MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=14336, gated_mlp=True, vocab_size=128256)
B, A, C = "TP2 CP4 a2a DP4", "TP1 CP16 a2a+p2p [8,2] DP2", "TP1 CP16 p2p DP2"


def main() -> None:
    print(f"{'inter GB/s':>10} {'TFLOP/s':>8} {'batch':>6} {'tp-ovl':>6}  {'pos B/A/C':>12} "
          f"{'B/A time':>9} {'C/A time':>9}  order  winner")
    held = total = 0
    for inter, tflops, gbs, ovl in itertools.product((25, 50, 100), (300, 400, 600), (8, 32),
                                                      (False, True)):
        cluster = Cluster(nodes=4, gpus_per_node=8, inter_bytes_per_second=inter * 1e9,
                          flops_per_second=tflops * 1e12)
        r = plan(MODEL, Batch.fixed_length(131072, gbs), cluster,
                 Options(tp_comm_overlap=ovl))
        pos = [r.find(x) for x in (B, A, C)]
        b, a, c = (r.ranked[p] for p in pos)
        ok = pos[0] < pos[1] < pos[2]
        held += ok
        total += 1
        print(f"{inter:>10} {tflops:>8} {gbs:>6} {str(ovl):>6}  {'/'.join(map(str, pos)):>12} "
              f"{b.step_seconds / a.step_seconds:>9.4f} {c.step_seconds / a.step_seconds:>9.4f}"
              f"  {'B<A<C' if ok else 'other'}  {r.winner.layout.label}")
    print(f"B < A < C in {held} of {total} settings")


if __name__ == "__main__":
    main()
