"""Dynamic-CP scheduler benchmark: this project's scheduler against same-run baselines.

Baselines, on the same batches and scored with the same cost model:

* ``upstream``: megatron-core 0.16.1's ``BalancedCPScheduler`` (imported from the installed
  package; it plans with its own ``seq_len**2 / cp`` model and ignores the packing cap);
* ``dp_balanced``: static CP, one fixed CP size that fits the longest sequence, sequences
  greedily balanced (largest first) over the DP replicas, which meet only at the step end.

Table 1 (FLOPs model): efficiency = ideal / makespan, ideal = total work / N, makespan = sum
over micro-batches of the slowest rank; ``enl`` = share of tokens on a larger group than their
smallest legal one; ``max s`` = the slowest batch's scheduling time (ours: median of 3 runs).
Table 2 (projected step, :mod:`megatron_hcp.dynamic_cp.projection`): dp_balanced seconds /
ours (scheduled with ``hardware=``) for several assumed links, and with no communication at
all (pure FLOPs, where static CP cannot lose balance).

Model and lengths follow megatron's DCP functional test ``gpt3_mcore_te_tp2_pp1_cp4_dcp``
(12 layers, hidden 512, 8 heads, lognormal 128..2048 mean 512 sigma 1.2, cap 512 tokens per
rank); long_tail adds 5 % of sequences up to N x cap.

Table 3 (``--hierarchical``, only that table): dynamic hierarchical CP on nodes of 8 GPUs with
two link classes (:class:`~megatron_hcp.dynamic_cp.projection.Cluster`: NVLink-like inside a
node, IB-like across), 8B- and 70B-like GQA models (8 KV heads), long-tail lengths up to 1M
tokens; projected step of static CP (dp_balanced, flat ring) against static HCP, flat dynamic
CP and dynamic HCP (a2a level = one node), all computed in the same run.

Table 4 (``--sweep``, only that table): robustness of the same scheduler (FLOPs mode) over
models (hidden 512 / 8B-like / 70B-like), caps 512..16384 tokens per rank, length mixes
(:mod:`megatron_hcp.dynamic_cp.mixes`) and N = 64, 256: efficiency (mean, min over batches),
the peak tokens per rank against the cap, the slowest scheduling time, and the lower bounds of
:mod:`megatron_hcp.dynamic_cp.bounds` (the FLOPs optimum is total work / N, so efficiency is
the ratio to that tight bound; ``nosplit`` = the bound for plans that keep every sequence on its
smallest legal group, as a share of ideal: below the target means the target needs spreading).

Run: ``.venv/bin/python benchmarks/dynamic_cp.py [--samples 2048] [--seeds 4]``;
``.venv/bin/python benchmarks/dynamic_cp.py --hierarchical [--seeds 3] [--inter-gbps 50]``;
``.venv/bin/python benchmarks/dynamic_cp.py --sweep [--seeds 2]``
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.dynamic_cp.bounds import free_split_bound, min_group_bound  # noqa: E402
from megatron_hcp.dynamic_cp.mixes import MIXES, length_mix  # noqa: E402
from megatron_hcp.dynamic_cp.projection import (  # noqa: E402
    Cluster,
    Hardware,
    dynamic_group_seconds,
    plan_seconds,
    projected_seconds,
    static_cp_seconds,
)
from megatron_hcp.dynamic_cp.scheduler import schedule  # noqa: E402
from megatron_hcp.dynamic_cp.workload import (  # noqa: E402
    GPTWorkload,
    min_group_size,
    tokens_per_rank,
)

MODEL = GPTWorkload(num_layers=12, hidden_size=512, num_attention_heads=8)
LARGE = GPTWorkload(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                    num_attention_heads=32, num_query_groups=8, gated_mlp=True)
CAP = 512
HARDWARE = {
    "nvlink": Hardware(bytes_per_second=200e9, latency_seconds=5e-6),
    "ib": Hardware(bytes_per_second=25e9, latency_seconds=15e-6),
    "no-comm": Hardware(bytes_per_second=float("inf"), latency_seconds=0.0),
}


def lognormal(rng, count, mean=512, sigma=1.2, lo=128, hi=2048):
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, count), lo, hi).astype(int).tolist()


def long_tail(rng, count, n, cap=CAP):
    """Mostly lognormal sequences plus 5 % up to N x cap tokens."""
    base = lognormal(rng, count)
    tail = rng.random(count) < 0.05
    longs = rng.integers(2048, n * cap - 2 * n, size=count)
    return [int(x) if t else b for b, t, x in zip(base, tail, longs)]


class _Size:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def upstream(lengths, n, model):
    """Run megatron-core's BalancedCPScheduler; score its plan with ``model``."""
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
        loads = [sum(model.cost(lengths[s], holders[s]) for s in ids) for ids in per_gpu]
        toks = [sum(tokens_per_rank(lengths[s], holders[s]) for s in ids) for ids in per_gpu]
        makespan += max(loads, default=0.0)
        peak = max(peak, max(toks, default=0))
    return makespan, peak, seconds


def dp_balanced(lengths, n, weight, cap=CAP):
    """Static CP fitting the longest sequence; largest-first greedy over the DP replicas."""
    c = min_group_size(max(lengths), cap, n)
    replicas: list[list[int]] = [[] for _ in range(n // c)]
    loads = np.zeros(n // c)
    for s in sorted(range(len(lengths)), key=lambda s: (-lengths[s], s)):
        r = int(np.argmin(loads))
        replicas[r].append(s)
        loads[r] += weight(lengths[s], c)
    return c, replicas


def flops_table(args, rng) -> None:
    print(f"Table 1 - FLOPs model (hidden {MODEL.hidden_size}, {MODEL.num_layers} layers), cap "
          f"{CAP} tokens/rank, {args.samples} samples per global batch, {args.seeds} batches "
          "per row (mean, min)")
    header = (f"{'batch':<9} {'N':>4} | {'ours eff':>8} {'min':>5} {'enl':>5} {'mbs':>4} "
              f"{'peak':>4} {'max s':>5} | {'upstream eff':>12} {'peak':>6} {'max s':>5} | "
              f"{'dp_bal eff':>10}")
    print(header)
    print("-" * len(header))
    for name in ("lognormal", "long_tail"):
        for n in (8, 16, 64, 256):
            rows = []
            for _ in range(args.seeds):
                lengths = (lognormal(rng, args.samples) if name == "lognormal"
                           else long_tail(rng, args.samples, n))
                ideal = sum(MODEL.cost(x, 1) for x in lengths) / n
                seconds = []
                for _ in range(3):  # the plan is deterministic; the median time is less noisy
                    t0 = time.perf_counter()
                    plan = schedule(lengths, n, CAP, workload=MODEL)
                    seconds.append(time.perf_counter() - t0)
                ours_s = float(np.median(seconds))
                s = plan.summary
                up, up_peak, up_s = upstream(lengths, n, MODEL)
                c, replicas = dp_balanced(lengths, n, MODEL.cost)
                dp = max(sum(MODEL.cost(lengths[i], c) for i in r) for r in replicas)
                rows.append((s["efficiency"], s["enlarged_token_fraction"], s["micro_batches"],
                             s["peak_tokens_per_rank"], ours_s, ideal / up, up_peak, up_s,
                             ideal / dp))
            r = np.array(rows)
            print(f"{name:<9} {n:>4} | {r[:, 0].mean():>8.3f} {r[:, 0].min():>5.3f} "
                  f"{r[:, 1].mean():>5.2f} {r[:, 2].mean():>4.0f} {r[:, 3].max():>4.0f} "
                  f"{r[:, 4].max():>5.2f} | {r[:, 5].mean():>12.3f} {r[:, 6].max():>6.0f} "
                  f"{r[:, 7].max():>5.2f} | {r[:, 8].mean():>10.3f}")


def projection_table(args, rng) -> None:
    print()
    print("Table 2 - projected step, dp_balanced / ours (ours scheduled with hardware=); "
          "upstream DCP lengths, cap 512")
    cases = [(4, 32), (8, 2048), (64, 2048), (256, 2048)]  # (N, samples); N=4, 32: the test
    header = f"{'model':<12} {'N':>4} {'samples':>7} {'static CP':>9} | " + " ".join(
        f"{k:>8}" for k in HARDWARE)
    print(header)
    print("-" * len(header))
    for label, model in (("hidden 512", MODEL), ("8B-like", LARGE)):
        for n, count in cases:
            ratios = {k: [] for k in HARDWARE}
            static_sizes = set()
            for _ in range(args.seeds):
                lengths = lognormal(rng, count)
                for key, hw in HARDWARE.items():
                    plan = schedule(lengths, n, CAP, workload=model, hardware=hw)
                    ours = plan_seconds(plan, lengths, model, hw)
                    c, replicas = dp_balanced(
                        lengths, n, functools.partial(projected_seconds, model, hw=hw))
                    static = static_cp_seconds(replicas, lengths, c, model, hw)
                    ratios[key].append(static / ours)
                    static_sizes.add(c)
            sizes = "/".join(map(str, sorted(static_sizes)))
            print(f"{label:<12} {n:>4} {count:>7} {sizes:>9} | " + " ".join(
                f"{np.mean(v):>7.2f}x" for v in ratios.values()))


LLAMA_70B = GPTWorkload(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                        num_attention_heads=64, num_query_groups=8, gated_mlp=True)
HCP_CAP = 16384  # tokens per rank: a 1M-token sequence needs 64 ranks


def long_tail_1m(rng, count, share):
    """Lognormal (median 4K, sigma 1, 256..128K) with ``share`` log-uniform 128K..1M tokens;
    at least one sequence of the tail and at most 1M tokens."""
    base = np.clip(rng.lognormal(np.log(4096), 1.0, count), 256, 131072)
    longs = np.exp(rng.uniform(np.log(131072), np.log(1 << 20), count))
    tail = rng.random(count) < share
    tail[0] = True
    return [min(int(x), 1 << 20) for x in np.where(tail, longs, base)]


# (tail share, sequences per rank): a heavy and a light tail of the same length range
TAILS = ((0.10, 2), (0.01, 8))


def hierarchical_table(args, rng) -> None:
    """Table 3: static CP vs static HCP vs flat dynamic CP vs dynamic HCP on two link classes."""
    cluster = Cluster(gpus_per_node=8, intra_bytes_per_second=args.intra_gbps * 1e9,
                      inter_bytes_per_second=args.inter_gbps * 1e9)
    a = cluster.gpus_per_node  # the a2a level: one node (8 KV heads: a2a <= 8)
    print(f"Table 3 - projected step on nodes of {a} GPUs: {args.intra_gbps:g} GB/s "
          f"{cluster.intra_latency_seconds * 1e6:g} us inside a node, {args.inter_gbps:g} GB/s "
          f"{cluster.inter_latency_seconds * 1e6:g} us across, "
          f"{cluster.flops_per_second / 1e12:g} TFLOP/s, TP 1, cap {HCP_CAP} tokens/rank, "
          f"HCP a2a level {a}; {args.seeds} batches per row; lengths lognormal median 4K "
          "(256..128K) plus a tail share of 128K..1M tokens (2 x N sequences with a 10 % tail, "
          "8 x N with 1 %); ratio = static CP seconds / seconds (same run, mean); mbs = dynamic "
          "HCP micro-batches, grp = token-weighted dynamic group size; a projection, not a "
          "measurement")
    header = (f"{'model':<9} {'tail':>4} {'N':>4} {'static CP [HCP]':>17} {'static CP s':>11} | "
              f"{'static HCP':>10} {'dyn CP':>7} {'dyn HCP':>7} | {'mbs':>4} {'grp CP':>6} "
              f"{'grp HCP':>7} {'sched s':>7}")
    print(header)
    print("-" * len(header))
    cases = [(label, model, share, per_rank, n)
             for label, model in (("8B-like", LARGE), ("70B-like", LLAMA_70B))
             for share, per_rank in TAILS for n in (64, 256)]
    for label, model, share, per_rank, n in cases:
        rows, static_sizes = [], set()
        for _ in range(args.seeds):
            lengths = long_tail_1m(rng, per_rank * n, share)
            row = []
            for hcp in (None, a):  # static CP (flat ring), static HCP [a, c / a]
                c, replicas = dp_balanced(
                    lengths, n, lambda x, c, h=hcp, m=model: dynamic_group_seconds(
                        m, x, range(c), cluster, h), HCP_CAP)
                row.append(static_cp_seconds(replicas, lengths, c, model, cluster, hcp))
                static_sizes.add(c)
            t0 = time.perf_counter()
            flat = schedule(lengths, n, HCP_CAP, workload=model, hardware=cluster)
            hier = schedule(lengths, n, HCP_CAP, workload=model, hardware=cluster,
                            hcp_a2a_size=a)
            seconds = (time.perf_counter() - t0) / 2
            row += [plan_seconds(flat, lengths, model, cluster),
                    plan_seconds(hier, lengths, model, cluster, a),
                    len(hier.micro_batches), flat.summary["mean_group_size"],
                    hier.summary["mean_group_size"], seconds]
            rows.append(row)
        r = np.array(rows)
        ratio = r[:, :1] / r[:, 1:4]
        static = "/".join(f"{c} [{a}x{c // a}]" for c in sorted(static_sizes))
        print(f"{label:<9} {share:>4.0%} {n:>4} {static:>17} {r[:, 0].mean():>11.2f} | "
              f"{ratio[:, 0].mean():>9.2f}x {ratio[:, 1].mean():>6.2f}x "
              f"{ratio[:, 2].mean():>6.2f}x | {r[:, 4].mean():>4.1f} {r[:, 5].mean():>6.1f} "
              f"{r[:, 6].mean():>7.1f} {r[:, 7].max():>7.2f}")


SWEEP_MODELS = {"h512": MODEL, "8B-like": LARGE, "70B-like": LLAMA_70B}
SWEEP_CAPS = (512, 1024, 2048, 4096, 8192, 16384)
TARGETS = {64: 0.97, 256: 0.96}


def sweep_table(args, rng) -> None:
    """Table 4: efficiency over models x caps x mixes x N, against the lower bounds."""
    print(f"Table 4 - robustness sweep (FLOPs model), {args.samples} samples per batch, "
          f"{args.seeds} batches per row (mean, min); targets: N=64 >= 0.97, N=256 >= 0.96")
    print(f"{'model':9} {'N':>4} {'cap':>6} {'mix':10} | {'eff':>6} {'min':>6} | "
          f"{'nosplit':>7} | {'peak/cap':>8} {'max s':>5} |")
    print("-" * 80)
    misses = 0
    for name, model in SWEEP_MODELS.items():
        for n in TARGETS:
            for cap in SWEEP_CAPS:
                for mix in MIXES:
                    effs, nosplit, peak, slowest = [], [], 0, 0.0
                    for _ in range(args.seeds):
                        lengths = length_mix(mix, rng, args.samples, n, cap)
                        t0 = time.perf_counter()
                        plan = schedule(lengths, n, cap, workload=model)
                        slowest = max(slowest, time.perf_counter() - t0)
                        ideal = free_split_bound(lengths, n, model)
                        assert abs(plan.summary["ideal"] - ideal) <= 1e-9 * ideal
                        effs.append(ideal / plan.summary["makespan"])
                        nosplit.append(ideal / min_group_bound(lengths, n, cap, model))
                        peak = max(peak, plan.summary["peak_tokens_per_rank"])
                    miss = min(effs) < TARGETS[n]
                    misses += miss
                    print(f"{name:9} {n:4d} {cap:6d} {mix:10} | {np.mean(effs):6.3f} "
                          f"{min(effs):6.3f} | {min(nosplit):7.3f} | {peak / cap:8.2f} "
                          f"{slowest:5.2f} |{' MISS' if miss else ''}")
    print(f"rows below the target: {misses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hierarchical", action="store_true",
                        help="only Table 3: dynamic HCP on two link classes (8B/70B-like)")
    parser.add_argument("--intra-gbps", type=float, default=450.0,
                        help="Table 3: GB/s per GPU inside a node")
    parser.add_argument("--inter-gbps", type=float, default=50.0,
                        help="Table 3: GB/s per GPU across nodes")
    parser.add_argument("--sweep", action="store_true",
                        help="only Table 4: models x caps x length mixes x N, with lower bounds")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.sweep:
        sweep_table(args, rng)
        return
    if args.hierarchical:
        hierarchical_table(args, rng)
        return
    flops_table(args, rng)
    projection_table(args, rng)


if __name__ == "__main__":
    main()
