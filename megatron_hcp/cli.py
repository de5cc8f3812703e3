"""``megatron-hcp`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _check_config(args: argparse.Namespace) -> int:
    from .config import CPConfig, CPConfigError

    try:
        config = CPConfig.from_pairs(args.pairs)
        advice = config.validate()
    except CPConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except Exception as err:  # never a traceback for user input
        print(f"invalid context-parallel configuration: {err}", file=sys.stderr)
        return 2
    print("configuration is valid")
    for line in advice:
        print(f"advice: {line}")
    return 0


def _int_list(text: str) -> list[int]:
    return [int(p) for p in text.strip("[]").split(",") if p.strip()]


def _layout(args: argparse.Namespace) -> int:
    from .parallel_state.layout import ParallelLayout
    from .parallel_state.report import describe_cp_groups

    try:
        layout = ParallelLayout(
            world_size=args.world_size,
            tp=args.tp,
            cp=args.cp,
            pp=args.pp,
            ep=args.ep,
            order=args.order,
            hierarchical_sizes=tuple(_int_list(args.hcp)) if args.hcp else None,
        )
    except ValueError as err:
        print(f"invalid layout: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(layout.to_json()))
    else:
        print("\n".join(describe_cp_groups(layout)))
    return 0


def _verify_groups(args: argparse.Namespace) -> int:
    from .config import CPConfig, CPConfigError
    from .local_world import LocalWorld
    from .parallel_state.selfcheck import check_mpu_groups

    hcp = _int_list(args.hcp) if args.hcp else None
    kwargs = dict(
        context_parallel_size=args.cp,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        data_parallel_size=args.world_size // (args.tp * args.cp * args.pp),
        cp_comm_type="a2a+p2p" if hcp else args.cp_comm_type,
        hierarchical_context_parallel_sizes=hcp,
    )
    try:
        CPConfig(**kwargs).validate()
    except CPConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"building process groups on {args.world_size} local gloo ranks: {kwargs}", flush=True)
    with LocalWorld(args.world_size) as world:
        results = world.run(check_mpu_groups, kwargs, args.order)
    for line in results[0]["lines"]:
        print(line)
    failures = 0
    for rank, result in enumerate(results):
        for name, (got, want, members) in result["checks"].items():
            ok = got == want
            failures += not ok
            print(
                f"rank {rank}: all_reduce(rank) over {name} {members} = {got} "
                f"(expected {want}) {'OK' if ok else 'MISMATCH'}"
            )
    print("verification " + ("passed" if not failures else f"FAILED ({failures} mismatches)"))
    return 0 if not failures else 1


def _patch_list(args: argparse.Namespace) -> int:
    from .bridge.hook import BRIDGE_PATCHES
    from .patching import ALL_PATCHES, is_applied
    from .patching.registry import installed_version

    for package, patches in (("megatron-core", ALL_PATCHES), ("megatron-bridge", BRIDGE_PATCHES)):
        version = installed_version(package)
        print(f"{package} {version or '(not installed)'}")
        print(f"  {'patch':<38} {'category':<12} {'versions':<14} {'needed':<7} {'applied':<7} "
              "summary")
        for patch in patches:
            needed = version is not None and patch.needed(version)
            missing = patch.missing_requirement()
            if needed and not missing:
                try:
                    applied = "yes" if is_applied(patch) else "no"
                except ImportError as err:  # e.g. Bridge installed, but its imports fail
                    applied, missing = "n/a", f"{package} does not import here ({err})"
            else:
                applied = "n/a"
            shown = ",".join(patch.versions) if len(patch.versions) <= 2 else (
                f"{patch.versions[0]}-{patch.versions[-1]}")
            print(f"  {patch.name:<38} {patch.category:<12} {shown:<14} "
                  f"{'yes' if needed else 'no':<7} {applied:<7} {patch.summary}")
            if args.verbose:
                print(f"  {'':<38} upstream: {patch.upstream}")
                print(f"  {'':<38} written for {package} {', '.join(patch.versions)}")
                if version is not None and not needed:
                    print(f"  {'':<38} {package} {version}: {patch.status(version)}")
                elif missing:
                    print(f"  {'':<38} not applicable here: {missing}")
    return 0


def _patch_fork(args: argparse.Namespace) -> int:
    """check | apply | revert the fork-style diffs of patches/ on a target tree."""
    from .patching import PatchError
    from .patching.forkpatch import apply_diffs, check_diffs, revert_diffs

    try:
        if args.patch_command == "check":
            version, statuses = check_diffs(args.target)
            print(f"megatron-core {version} at {args.target}")
            for s in statuses:
                label = s.file.name if s.file is not None else s.name
                print(f"  {label:<50} {s.state}"
                      + (f"  ({s.detail.splitlines()[0]})" if s.detail else ""))
            return 0 if all(s.state != "conflicts" for s in statuses) else 1
        done = (apply_diffs if args.patch_command == "apply" else revert_diffs)(args.target)
        verb = "applied" if args.patch_command == "apply" else "reverted"
        print(f"{verb} {len(done)} patch(es)" + (f": {', '.join(done)}" if done else
                                                  " (nothing to do)"))
        return 0
    except PatchError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2


def _schedule(args: argparse.Namespace) -> int:
    from .dynamic_cp.projection import Hardware, plan_seconds
    from .dynamic_cp.scheduler import schedule
    from .dynamic_cp.workload import GPTWorkload, ScheduleError

    try:
        with open(args.lengths, encoding="utf-8") as f:
            lengths = json.load(f)
        if not isinstance(lengths, list):
            raise ScheduleError(f"{args.lengths} must hold a JSON list of sequence lengths")
        workload = GPTWorkload(num_layers=args.layers, hidden_size=args.hidden,
                               ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                               num_query_groups=args.kv_heads, gated_mlp=args.gated_mlp,
                               mode=args.cost)
        hardware = None
        if args.link_gbps is not None:
            hardware = Hardware(flops_per_second=args.tflops * 1e12,
                                bytes_per_second=args.link_gbps * 1e9,
                                latency_seconds=args.link_latency_us * 1e-6)
        plan = schedule(lengths, args.dp_cp, args.max_seqlen_per_rank, workload=workload,
                        min_cp_size=args.min_cp_size, vpp=args.vpp, hardware=hardware)
    except (ScheduleError, OSError, ValueError) as err:
        print(f"cannot schedule: {err}", file=sys.stderr)
        return 2
    if args.plot:
        from .dynamic_cp.plot import plot_plan

        plot_plan(plan, lengths, workload, args.plot)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    s = plan.summary
    print(f"{s['micro_batches']} micro-batches, efficiency {s['efficiency']:.3f} "
          f"(makespan {s['makespan']:.4g}, ideal {s['ideal']:.4g}), idle rank-slots "
          f"{s['idle_rank_slots']}, peak tokens per rank {s['peak_tokens_per_rank']} / cap "
          f"{s['cap']}, tokens on a larger group than needed "
          f"{100 * s['enlarged_token_fraction']:.1f} %")
    if hardware is not None:
        print(f"projected step {plan_seconds(plan, lengths, workload, hardware) * 1e3:.3f} ms")
    for j, mb in enumerate(s["per_micro_batch"]):
        print(f"  micro-batch {j}: max {mb['max']:.4g} mean {mb['mean']:.4g}")
    for note in plan.notes:
        print(f"note: {note}")
    return 0


def _functional(args: argparse.Namespace) -> int:
    from .config import CPConfigError
    from .functional import harness
    from .functional.recipe import list_recipes

    try:
        if args.functional_command == "list":
            for name in list_recipes():
                print(name)
            return 0
        if args.functional_command == "update-golden":
            for name in args.names:
                for line in harness.update_golden(name):
                    print(line)
            return 0
        names = args.names or (list_recipes() if args.functional_command == "compare" else [])
        if not names:
            print("name a recipe (see `megatron-hcp functional list`)", file=sys.stderr)
            return 2
        results = []
        for name in names:
            print(f"=== {name}", flush=True)
            result = harness.check_recipe(name, steps=args.steps,
                                          cp_invariance=not args.no_cp1)
            for line in result.lines:
                print(f"  {line}")
            results.append(result)
        print()
        print(harness.summary_table(results))
        return 0 if all(r.passed for r in results) else 1
    except CPConfigError as err:
        print(f"invalid recipe: {err}", file=sys.stderr)
        return 2
    except (harness.RecipeRunError, FileNotFoundError) as err:
        print(str(err), file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    from .planner import command as plan_command

    parser = argparse.ArgumentParser(prog="megatron-hcp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check-config", help="validate a CP configuration (megatron field names)")
    p.add_argument("pairs", nargs="*", metavar="key=value")
    p.set_defaults(func=_check_config)

    p = sub.add_parser("layout", help="print the CP / HCP rank layout")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--hcp", default=None, help="hierarchical sizes a2a,p2p (e.g. 2,2)")
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_layout)

    p = sub.add_parser(
        "verify-groups", help="build megatron's (H)CP groups on local gloo ranks and verify them"
    )
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--hcp", default="2,2")
    p.add_argument("--cp-comm-type", default="p2p", help="used when --hcp is empty")
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.set_defaults(func=_verify_groups)

    p = sub.add_parser("schedule", help="plan dynamic-CP micro-batches for a global batch")
    p.add_argument("--dp-cp", type=int, required=True)
    p.add_argument("--max-seqlen-per-rank", type=int, required=True)
    p.add_argument("--min-cp-size", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--cost", choices=["flops", "seq_squared"], default="flops")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (3 matmuls)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="rank plans by projected step time: CP link GB/s (with --tflops, "
                        "--link-latency-us); default: FLOPs makespan")
    p.add_argument("--link-latency-us", type=float, default=10.0)
    p.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per rank")
    p.add_argument("--lengths", required=True, help="JSON file: a list of sequence lengths")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a Gantt chart (PNG)")
    p.set_defaults(func=_schedule)

    p = sub.add_parser("plan", help="rank TP/CP/PP/DP, cp_comm_type, HCP sizes and dynamic-CP "
                                    "knobs for a model on a cluster (projected step time, memory)")
    plan_command.add_arguments(p)
    p.set_defaults(func=plan_command.run)

    patch = sub.add_parser("patch", help="runtime patches of megatron-core")
    patch_sub = patch.add_subparsers(dest="patch_command", required=True)
    p = patch_sub.add_parser("list", help="every patch, its upstream versions, applied or not")
    p.add_argument("-v", "--verbose", action="store_true", help="show the upstream lines")
    p.set_defaults(func=_patch_list)
    for cmd, text in (("check", "each fork-style diff of patches/: applied, applicable or "
                                "conflicts"),
                      ("apply", "apply every diff not yet applied (atomic)"),
                      ("revert", "revert every applied diff (atomic)")):
        p = patch_sub.add_parser(cmd, help=text)
        p.add_argument("--target", required=True,
                       help="a Megatron-LM checkout or an installed megatron package directory")
        p.set_defaults(func=_patch_fork)

    fn = sub.add_parser("functional", help="functional recipes with golden values (CPU/gloo)")
    fn_sub = fn.add_subparsers(dest="functional_command", required=True)
    p = fn_sub.add_parser("list", help="the recipes")
    p.set_defaults(func=_functional)
    for cmd, text in (("run", "run recipes and compare them (golden values, CP=1)"),
                      ("compare", "run and compare every recipe (or the named ones)")):
        p = fn_sub.add_parser(cmd, help=text)
        p.add_argument("names", nargs="*")
        p.add_argument("--steps", type=int, default=None, help="train this many steps")
        p.add_argument("--no-cp1", action="store_true", help="skip the CP=1 invariance run")
        p.set_defaults(func=_functional)
    p = fn_sub.add_parser("update-golden", help="regenerate golden values; say what changed")
    p.add_argument("names", nargs="+")
    p.set_defaults(func=_functional)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
