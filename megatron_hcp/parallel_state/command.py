"""``megatron-hcp check-config | layout | verify-groups``: a CP setup validated, its rank layout
printed, its process groups built on local gloo ranks and checked."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ..command_line import Sizes, UsageError, one_line, typed

__all__ = ["MAX_LOCAL_RANKS", "add_parsers", "parallel_flags"]

MAX_LOCAL_RANKS = 64  # verify-groups starts this many processes on this machine at most


def _check_config(args: argparse.Namespace) -> int:
    from ..config import CPConfig, CPConfigError

    if {"-h", "--help"} & set(args.args):
        print("usage: megatron-hcp check-config --context-parallel-size 4 --cp-comm-type a2a+p2p "
              "--hierarchical-context-parallel-sizes 2 2 [--flag value ...]  (megatron flag "
              "names of CPConfig's fields; key=value is an alias)")
        return 0
    try:
        config = CPConfig.from_args(args.args)
        advice = config.validate()
    except CPConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print("configuration is valid")
    for line in advice:
        print(f"advice: {line}")
    return 0


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The CPConfig fields of a ``layout`` / ``verify-groups`` command line."""
    model = args.tp * args.cp * args.pp
    if args.world_size % model:
        raise UsageError(f"--world-size {args.world_size} must be a multiple of tp*cp*pp="
                         f"{model}; change --world-size or the sizes")
    return dict(
        context_parallel_size=args.cp,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        data_parallel_size=args.world_size // model,
        # hierarchical sizes imply a2a+p2p only when no comm type is given; a given one is kept
        # (and CPConfig refuses sizes without a2a+p2p, saying so)
        cp_comm_type=getattr(args, "cp_comm_type", None) or ("a2a+p2p" if args.hcp else None),
        hierarchical_context_parallel_sizes=args.hcp or None,
    )


def _topology(args: argparse.Namespace):
    """The :class:`~megatron_hcp.config.Topology` of ``args`` (``CPConfig.resolve``: every
    rule, the order, the expert sizes), before anything starts."""
    from ..config import CPConfig, CPConfigError

    try:
        return CPConfig(**_config_kwargs(args)).resolve(
            args.world_size, expert_model_parallel_size=getattr(args, "ep", 1), order=args.order)
    except (CPConfigError, ValueError) as err:
        raise UsageError(f"invalid layout: {one_line(err)}") from None


def _layout(args: argparse.Namespace) -> int:
    from .report import describe_cp_groups

    layout = args.checked
    if args.json:
        print(json.dumps(layout.to_json()))
    else:
        print("\n".join(describe_cp_groups(layout)))
    return 0


def _verify_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """CPConfig fields of a verify-groups run, validated and resolved before any process
    starts."""
    _topology(args)
    return _config_kwargs(args)


def _verify_groups(args: argparse.Namespace) -> int:
    from ..harness.local_world import LocalWorld
    from .selfcheck import check_mpu_groups

    kwargs = args.checked
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


def parallel_flags(p: argparse.ArgumentParser, size: Callable[[str], Any], *, tp: int,
                   cp: int) -> None:
    """The parallel sizes of a CP setup under megatron's flag names (short aliases kept)."""
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=size, default=tp)
    p.add_argument("--context-parallel-size", "--cp", dest="cp", type=size, default=cp)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=size, default=1)
    p.add_argument("--hierarchical-context-parallel-sizes", "--hcp", dest="hcp", nargs="+",
                   action=Sizes, default=None, metavar="SIZE",
                   type=typed("sizes", "--hierarchical-context-parallel-sizes"),
                   help="the a2a and p2p level sizes: 2 2 (or 2,2)")


def add_parsers(sub: Any) -> None:
    """Register check-config, layout and verify-groups."""
    from ..config import CP_COMM_TYPES

    size = typed("size")
    # every argument is a megatron flag or value of the CP setup, read by CPConfig.from_args
    # (the subparser's own options use "+": "+h" for help)
    p = sub.add_parser(
        "check-config", prefix_chars="+", add_help=False,
        help="validate a CP configuration: megatron flags (--context-parallel-size 4 "
             "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 ...; "
             "key=value is an alias)")
    p.add_argument("+h", action="help", help="show this help message and exit")
    p.add_argument("args", nargs="*", metavar="--flag value")
    p.set_defaults(func=_check_config)

    p = sub.add_parser("layout", help="print the CP / HCP rank layout")
    p.add_argument("--world-size", type=size, required=True)
    parallel_flags(p, size, tp=1, cp=1)
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=size, default=1)
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_layout, check=_topology)

    p = sub.add_parser(
        "verify-groups", help="build megatron's (H)CP groups on local gloo ranks and verify them"
    )
    p.add_argument("--world-size", type=typed("int", minimum=1, maximum=MAX_LOCAL_RANKS),
                   default=8, help=f"local ranks (at most {MAX_LOCAL_RANKS})")
    parallel_flags(p, size, tp=2, cp=4)
    p.add_argument("--cp-comm-type", default=None, choices=list(CP_COMM_TYPES),
                   help="default: a2a+p2p with hierarchical sizes, else megatron's p2p")
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.set_defaults(func=_verify_groups, check=_verify_kwargs)
