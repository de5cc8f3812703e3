"""``megatron-hcp schedule``: a global batch's dynamic-CP micro-batches, their summary, the
projected step (one link or two link classes) and a Gantt chart."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..command_line import Sizes, UsageError, one_line, output_file, read_lengths, typed
from .scheduler import SCHEDULE_MAX_DP_CP, SCHEDULE_MAX_VPP

__all__ = ["SCHEDULE_MAX_DP_CP", "add_parsers"]

_TWO_LINK_FLAGS = ("gpus_per_node", "intra_gbps", "inter_gbps", "intra_latency_us",
                   "inter_latency_us")


def _schedule_check(args: argparse.Namespace) -> list[int]:
    """The schedule input, the link dialect (one link or two classes), the HCP sizes, the
    head counts and the ``--plot`` path."""
    args.plot_path = output_file(args.plot) if args.plot is not None else None
    lengths = read_lengths(args.lengths)
    kv = args.kv_heads if args.kv_heads is not None else args.heads
    if kv > args.heads or args.heads % kv:
        raise UsageError(f"--kv-heads {kv} must divide --heads {args.heads} (query groups "
                         "share the heads evenly); give a divisor of --heads")
    two_link = [f"--{n.replace('_', '-')}" for n in _TWO_LINK_FLAGS
                if getattr(args, n) is not None]
    if args.hcp:
        two_link.append("--hierarchical-context-parallel-sizes")
    one_link = [f for f, v in (("--link-gbps", args.link_gbps),
                               ("--link-latency-us", args.link_latency_us)) if v is not None]
    if two_link and one_link:
        raise UsageError(f"{' '.join(one_link)} (one link for every group) cannot be combined "
                         f"with {' '.join(two_link)} (two link classes); use --intra-gbps / "
                         "--inter-gbps (and their latencies) instead of --link-gbps")
    if (two_link or one_link) and args.cost != "flops":
        flag = (two_link or one_link)[0]
        raise UsageError(f"--cost {args.cost}: ranking by projected time ({flag}) needs "
                         "--cost flops; drop the link flags or use --cost flops")
    args.hcp_a2a_size = None
    if args.hcp:
        args.hcp_a2a_size = _dynamic_hcp_a2a_size(args)
    return lengths


def _dynamic_hcp_a2a_size(args: argparse.Namespace) -> int:
    """Validate ``--hierarchical-context-parallel-sizes a p`` as dynamic hierarchical CP on
    DPxCP = ``--dp-cp`` (CPConfig's rules) and return the a2a size ``a``."""
    from ..config import CPConfig, CPConfigError

    sizes = list(args.hcp)
    cp = 1
    for size in sizes:
        cp *= size
    if args.dp_cp % cp:
        raise UsageError(
            f"hierarchical_context_parallel_sizes={sizes}: their product {cp} is the "
            f"context-parallel size and must divide --dp-cp {args.dp_cp} (DPxCP); give sizes "
            f"[a2a, p2p] whose product divides {args.dp_cp}")
    try:
        CPConfig(context_parallel_size=cp, data_parallel_size=args.dp_cp // cp,
                 cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=sizes,
                 dynamic_context_parallel=True,
                 min_dynamic_context_parallel_size=args.min_cp_size,
                 max_seqlen_per_dp_cp_rank=args.max_seqlen_per_rank,
                 num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                 cp_attention_backend="reference", cp_partition_mode=args.cp_partition_mode,
                 window_size=None if args.window is None else [args.window, 0]).validate()
    except CPConfigError as err:
        raise UsageError(one_line(err)) from None
    return sizes[0]


def _schedule(args: argparse.Namespace) -> int:
    from ..config import describe_levels, dynamic_levels
    from .projection import Cluster, Hardware, plan_seconds
    from .scheduler import schedule
    from .workload import GPTWorkload, ScheduleError

    lengths = args.checked
    workload = GPTWorkload(num_layers=args.layers, hidden_size=args.hidden,
                           ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                           num_query_groups=args.kv_heads, gated_mlp=args.gated_mlp,
                           mode=args.cost, window=args.window,
                           cp_partition_mode=args.cp_partition_mode)
    hardware: Hardware | Cluster | None = None
    a2a_size = args.hcp_a2a_size
    if args.link_gbps is not None:
        hardware = Hardware(flops_per_second=args.tflops * 1e12,
                            bytes_per_second=args.link_gbps * 1e9,
                            latency_seconds=(args.link_latency_us if args.link_latency_us
                                             is not None else 10.0) * 1e-6)
    elif a2a_size is not None or any(getattr(args, n) is not None for n in _TWO_LINK_FLAGS):
        defaults = Cluster()
        per_node = args.gpus_per_node or defaults.gpus_per_node

        def pick(value, default):
            return default if value is None else value

        hardware = Cluster(
            nodes=max(1, -(-args.dp_cp // per_node)), gpus_per_node=per_node,
            flops_per_second=args.tflops * 1e12,
            intra_bytes_per_second=pick(args.intra_gbps, defaults.intra_bytes_per_second / 1e9)
            * 1e9,
            inter_bytes_per_second=pick(args.inter_gbps, defaults.inter_bytes_per_second / 1e9)
            * 1e9,
            intra_latency_seconds=pick(args.intra_latency_us,
                                       defaults.intra_latency_seconds * 1e6) * 1e-6,
            inter_latency_seconds=pick(args.inter_latency_us,
                                       defaults.inter_latency_seconds * 1e6) * 1e-6)
    try:
        plan = schedule(lengths, args.dp_cp, args.max_seqlen_per_rank, workload=workload,
                        min_cp_size=args.min_cp_size, vpp=args.vpp, hardware=hardware,
                        hcp_a2a_size=a2a_size)
    except ScheduleError as err:
        print(f"cannot schedule: {one_line(err)}", file=sys.stderr)
        return 2
    if args.plot_path is not None:
        from .plot import plot_plan

        plot_plan(plan, lengths, workload, args.plot_path)
        print(f"plot: {args.plot_path}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        out = plan.to_json()
        if a2a_size is not None:  # the levels each group runs with
            for mb in out["micro_batches"]:
                for g in mb["groups"]:
                    g["a2a"], g["p2p"] = dynamic_levels(len(g["ranks"]), a2a_size)
        print(json.dumps(out))
        return 0
    s = plan.summary
    print(f"{s['micro_batches']} micro-batches, efficiency {s['efficiency']:.3f} "
          f"(makespan {s['makespan']:.4g}, ideal {s['ideal']:.4g}), idle rank-slots "
          f"{s['idle_rank_slots']}, peak tokens per rank {s['peak_tokens_per_rank']} / cap "
          f"{s['cap']}, tokens on a larger group than needed "
          f"{100 * s['enlarged_token_fraction']:.1f} %")
    if isinstance(hardware, Cluster):
        c = hardware
        print(f"ranked on 2 link classes: {c.gpus_per_node} GPUs per node, "
              f"{c.intra_bytes_per_second / 1e9:g} GB/s {c.intra_latency_seconds * 1e6:g} us "
              f"inside, {c.inter_bytes_per_second / 1e9:g} GB/s "
              f"{c.inter_latency_seconds * 1e6:g} us across, {c.flops_per_second / 1e12:g} "
              "TFLOP/s; " + (f"dynamic hierarchical CP, a2a level {a2a_size} "
                             f"(hierarchical_context_parallel_sizes {list(args.hcp)})"
                             if a2a_size is not None else "flat dynamic CP (p2p ring)"))
    if hardware is not None:
        print(f"projected step "
              f"{plan_seconds(plan, lengths, workload, hardware, a2a_size) * 1e3:.3f} ms "
              "(a projection, not a measurement)")
    for j, (mb, load) in enumerate(zip(plan.micro_batches, s["per_micro_batch"])):
        print(f"  micro-batch {j}: max {load['max']:.4g} mean {load['mean']:.4g}")
        for g in mb.groups:
            ranks = (f"rank {g.ranks[0]}" if len(g.ranks) == 1
                     else f"ranks {g.ranks[0]}-{g.ranks[-1]}")
            levels = describe_levels(len(g.ranks), a2a_size)
            print(f"    group of {len(g.ranks)} ({ranks}) = {levels}: samples {list(g.samples)}")
    for note in plan.notes:
        print(f"note: {note}")
    return 0


def add_parsers(sub: Any) -> None:
    """Register schedule."""
    from ..config import CP_PARTITION_MODES, LIMITS

    size = typed("size")
    p = sub.add_parser("schedule", help="plan dynamic-CP micro-batches for a global batch")
    p.add_argument("--dp-cp", type=typed("int", "--dp-cp", minimum=1,
                                          maximum=SCHEDULE_MAX_DP_CP), required=True,
                   help=f"ranks of the DPxCP group (at most {SCHEDULE_MAX_DP_CP}: "
                        "benchmarks/input_limits.py)")
    p.add_argument("--max-seqlen-per-rank", type=typed("seqlen", "--max-seqlen-per-rank"),
                   required=True)
    p.add_argument("--min-cp-size", type=size, default=1)
    p.add_argument("--vpp", type=typed("int", minimum=1, maximum=SCHEDULE_MAX_VPP), default=1)
    p.add_argument("--cost", choices=["flops", "seq_squared"], default="flops")
    p.add_argument("--hidden", type=typed("width", "--hidden"), default=4096)
    p.add_argument("--layers", type=typed("int", "--layers", minimum=0,
                                           maximum=LIMITS["layers"]), default=1)
    p.add_argument("--heads", type=typed("heads", "--heads"), default=32)
    p.add_argument("--kv-heads", type=typed("heads", "--kv-heads"), default=None)
    p.add_argument("--ffn", type=typed("width", "--ffn"), default=None)
    p.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (3 matmuls)")
    p.add_argument("--window", type=typed("seqlen", "--window"), default=None,
                   help="causal sliding window of this many tokens back (megatron's "
                        "--window-size W 0)")
    p.add_argument("--cp-partition-mode", choices=list(CP_PARTITION_MODES),
                   default=CP_PARTITION_MODES[0],
                   help="the layout the groups cut sequences in: its padding for the cap, "
                        "and contiguous slices' causal imbalance (the last rank's share)")
    p.add_argument("--link-gbps", type=typed("float", above=0.0, maximum=1e6), default=None,
                   help="rank plans by projected step time on ONE link for every group: GB/s "
                        "(with --tflops, --link-latency-us); default: FLOPs makespan")
    latency = typed("float", minimum=0.0, maximum=1e6)
    p.add_argument("--link-latency-us", type=latency, default=None,
                   help="with --link-gbps (default 10)")
    p.add_argument("--tflops", type=typed("float", above=0.0, maximum=1e6), default=400.0,
                   help="achieved TFLOP/s per rank")
    two = p.add_argument_group(
        "two link classes (the planner's flags; any of them ranks by projected step time on a "
        "node / across nodes; defaults: H100 SXM nodes as in `megatron-hcp plan`)")
    two.add_argument("--gpus-per-node", type=size, default=None,
                     help="ranks per node (default 8); the ranks are DPxCP ranks of TP 1 - "
                          "with TP > 1 give GPUs per node / TP")
    two.add_argument("--intra-gbps", type=typed("float", above=0.0, maximum=1e6), default=None,
                     help="GB/s per GPU inside a node (default 450)")
    two.add_argument("--inter-gbps", type=typed("float", above=0.0, maximum=1e6), default=None,
                     help="GB/s per GPU across nodes (default 50)")
    two.add_argument("--intra-latency-us", type=latency, default=None,
                     help="default 5")
    two.add_argument("--inter-latency-us", type=latency, default=None,
                     help="default 10")
    two.add_argument("--hierarchical-context-parallel-sizes", "--hcp", dest="hcp", nargs="+",
                     action=Sizes, default=None, metavar="SIZE",
                     type=typed("sizes", "--hierarchical-context-parallel-sizes"),
                     help="dynamic hierarchical CP [a2a, p2p]: a group of c ranks runs a2a "
                          "over min(c, a2a) and a p2p ring over the rest (implies two link "
                          "classes)")
    p.add_argument("--lengths", required=True, help="JSON file: a list of sequence lengths")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a Gantt chart (PNG)")
    p.set_defaults(func=_schedule, check=_schedule_check)
