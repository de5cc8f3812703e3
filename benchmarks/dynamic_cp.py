"""Dynamic-CP scheduler benchmark: this project's scheduler against same-run baselines.

Baselines, on the same batches and scored with the same FLOPs cost model:

* ``upstream``: megatron-core 0.16.1's ``BalancedCPScheduler`` (imported from the installed
  package; it plans with its own ``seq_len**2 / cp`` model and ignores the packing cap);
* ``dp_balanced``: static CP, one fixed CP size that fits the longest sequence, sequences
  greedily balanced (largest first) over the DP replicas.

Efficiency = ideal / makespan, ideal = total work / N, makespan = sum over micro-batches of the
slowest rank. Run: ``.venv/bin/python benchmarks/dynamic_cp.py [--samples 2048]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.dynamic_cp.scheduler import schedule  # noqa: E402
from megatron_hcp.dynamic_cp.workload import (  # noqa: E402
    GPTWorkload,
    min_group_size,
    tokens_per_rank,
)

MODEL = GPTWorkload(num_layers=1, hidden_size=1024, num_attention_heads=16)
CAP = 1024


def lognormal(rng, count, mean=512, sigma=1.2, lo=128, hi=2048):
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, count), lo, hi).astype(int).tolist()


def long_tail(rng, count, n):
    """Mostly short sequences plus a heavy tail up to N x cap tokens."""
    base = lognormal(rng, count)
    tail = rng.random(count) < 0.05
    longs = rng.integers(2048, n * CAP - 2 * n, size=count)
    return [int(x) if t else b for b, t, x in zip(base, tail, longs)]


class _Size:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def upstream_makespan(lengths, n):
    """Run megatron-core's BalancedCPScheduler; score its plan with MODEL."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    sched = BalancedCPScheduler(CAP, _Size(n))
    t0 = time.perf_counter()
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(lengths)), None)
    seconds = time.perf_counter() - t0
    makespan, peak = 0.0, 0
    for per_gpu in sample_id_groups:
        holders: dict[int, int] = {}
        for ids in per_gpu:
            for s in ids:
                holders[s] = holders.get(s, 0) + 1
        loads = [sum(MODEL.cost(lengths[s], holders[s]) for s in ids) for ids in per_gpu]
        toks = [sum(tokens_per_rank(lengths[s], holders[s]) for s in ids) for ids in per_gpu]
        makespan += max(loads, default=0.0)
        peak = max(peak, max(toks, default=0))
    return makespan, peak, len(sample_id_groups), seconds


def dp_balanced_makespan(lengths, n):
    """Static CP fitting the longest sequence; largest-first greedy over DP replicas."""
    c = min_group_size(max(lengths), CAP, n)
    replicas = np.zeros(n // c)
    for length in sorted(lengths, reverse=True):
        replicas[int(np.argmin(replicas))] += MODEL.cost(length, c)
    return float(replicas.max())


def ideal(lengths, n):
    return sum(MODEL.cost(length, 1) for length in lengths) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"FLOPs model: hidden {MODEL.hidden_size}, cap {CAP} tokens/rank, "
          f"{args.samples} samples per global batch")
    header = (f"{'batch':<10} {'N':>4} | {'ours eff':>8} {'mbs':>4} {'peak':>5} {'s':>6} | "
              f"{'upstream eff':>12} {'mbs':>4} {'peak':>6} {'s':>6} | {'dp_bal eff':>10} | "
              f"{'ours vs dp_bal':>14}")
    print(header)
    print("-" * len(header))
    for name in ("lognormal", "long_tail"):
        for n in (8, 16, 64, 256):
            lengths = lognormal(rng, args.samples) if name == "lognormal" else long_tail(
                rng, args.samples, n)
            best = ideal(lengths, n)
            t0 = time.perf_counter()
            plan = schedule(lengths, n, CAP, workload=MODEL)
            ours_s = time.perf_counter() - t0
            ours = plan.summary
            up, up_peak, up_mbs, up_s = upstream_makespan(lengths, n)
            dp = dp_balanced_makespan(lengths, n)
            print(f"{name:<10} {n:>4} | {ours['efficiency']:>8.3f} {ours['micro_batches']:>4} "
                  f"{ours['peak_tokens_per_rank']:>5} {ours_s:>6.2f} | {best / up:>12.3f} "
                  f"{up_mbs:>4} {up_peak:>6} {up_s:>6.2f} | {best / dp:>10.3f} | "
                  f"{dp / ours['makespan']:>13.2f}x")


if __name__ == "__main__":
    main()
