"""``megatron-hcp`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["UsageError", "build_parser", "main", "parse_and_check"]

MAX_LOCAL_RANKS = 64  # verify-groups starts this many processes on this machine at most


class UsageError(ValueError):
    """Bad command-line input found before anything runs (exit 2, one line)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _typed(kind: str, name: str = "the value", **bounds: Any) -> Callable[[str], Any]:
    """An argparse ``type`` that reads the value with the one strict parser (config.values)."""
    from .config import argument_type

    return argument_type(kind, name, **bounds)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _check_config(args: argparse.Namespace) -> int:
    from .config import CPConfig, CPConfigError

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


def _parallel_layout(args: argparse.Namespace):
    """The pure layout of ``args`` (validates sizes, order and HCP levels)."""
    from .parallel_state.layout import ParallelLayout

    try:
        return ParallelLayout(
            world_size=args.world_size, tp=args.tp, cp=args.cp, pp=args.pp,
            ep=getattr(args, "ep", 1), order=args.order,
            hierarchical_sizes=tuple(args.hcp) if args.hcp else None)
    except ValueError as err:
        raise UsageError(f"invalid layout: {_one_line(err)}") from None


def _layout(args: argparse.Namespace) -> int:
    from .parallel_state.report import describe_cp_groups

    layout = args.checked
    if args.json:
        print(json.dumps(layout.to_json()))
    else:
        print("\n".join(describe_cp_groups(layout)))
    return 0


def _verify_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """CPConfig fields of a verify-groups run, validated before any process starts."""
    from .config import CPConfig, CPConfigError

    model = args.tp * args.cp * args.pp
    if args.world_size % model:
        raise UsageError(f"--world-size {args.world_size} must be a multiple of tp*cp*pp="
                         f"{model}; change --world-size or the sizes")
    _parallel_layout(args)
    kwargs = dict(
        context_parallel_size=args.cp,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        data_parallel_size=args.world_size // model,
        # hierarchical sizes imply a2a+p2p only when no comm type is given; a given one is kept
        # (and CPConfig refuses sizes without a2a+p2p, saying so)
        cp_comm_type=args.cp_comm_type or ("a2a+p2p" if args.hcp else None),
        hierarchical_context_parallel_sizes=args.hcp or None,
    )
    try:
        CPConfig(**kwargs).validate()
    except CPConfigError as err:
        raise UsageError(_one_line(err)) from None
    return kwargs


def _verify_groups(args: argparse.Namespace) -> int:
    from .local_world import LocalWorld
    from .parallel_state.selfcheck import check_mpu_groups

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


def _patch_list(args: argparse.Namespace) -> int:
    from .bridge.cpu_runtime import BRIDGE_CPU_RUNTIME_PATCHES, BRIDGE_RUNTIME_PATCHES
    from .bridge.hook import BRIDGE_LOOP_PATCHES, BRIDGE_PATCHES
    from .patching import ALL_PATCHES, is_applied
    from .patching.registry import installed_version

    bridge = (BRIDGE_PATCHES + BRIDGE_LOOP_PATCHES + BRIDGE_RUNTIME_PATCHES
              + BRIDGE_CPU_RUNTIME_PATCHES)
    for package, patches in (("megatron-core", ALL_PATCHES), ("megatron-bridge", bridge)):
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


def _patch_target(args: argparse.Namespace) -> str:
    import os

    if not os.path.isdir(args.target):
        raise UsageError(f"--target {args.target!r} is not a directory; give a Megatron-LM "
                         "checkout or an installed megatron package directory")
    return args.target


def _patch_fork(args: argparse.Namespace) -> int:
    """check | apply | revert the fork-style diffs of patches/ on a target tree."""
    from .patching import PatchError
    from .patching.forkpatch import apply_diffs, check_diffs, revert_diffs

    def note(line: str) -> None:  # waiting for the lock; an interrupted transaction finished
        print(f"megatron-hcp patch: {line}", file=sys.stderr, flush=True)

    locking = {"lock_timeout": args.lock_timeout, "notify": note}
    try:
        if args.patch_command == "check":
            version, statuses = check_diffs(args.target, **locking)
            print(f"megatron-core {version} at {args.target}")
            for s in statuses:
                label = s.file.name if s.file is not None else s.name
                print(f"  {label:<50} {s.state}"
                      + (f"  ({s.detail.splitlines()[0]})" if s.detail else ""))
            return 0 if all(s.state != "conflicts" for s in statuses) else 1
        done = (apply_diffs if args.patch_command == "apply" else revert_diffs)(
            args.target, **locking)
        verb = "applied" if args.patch_command == "apply" else "reverted"
        print(f"{verb} {len(done)} patch(es)" + (f": {', '.join(done)}" if done else
                                                  " (nothing to do)"))
        return 0
    except PatchError as err:
        print(f"refused: {_one_line(err)}", file=sys.stderr)
        return 2


def _read_lengths(path: str) -> list[int]:
    """The schedule input: a JSON list of at most ``MAX_SEQUENCES`` integer sequence lengths,
    each at most ``MAX_SEQ_LENGTH`` (bounded reader; nothing coerced)."""
    from .bounded_read import InputFileError, read_json
    from .config import MAX_SEQ_LENGTH, MAX_SEQUENCES, CPConfigError, parse_int

    try:
        lengths = read_json(path, "--lengths")
    except InputFileError as err:
        raise UsageError(_one_line(err)) from None
    if not isinstance(lengths, list):
        raise UsageError(f"--lengths {path!r} must hold a JSON list of sequence lengths, "
                         f"got {type(lengths).__name__}")
    if len(lengths) > MAX_SEQUENCES:
        raise UsageError(f"--lengths {path!r} holds {len(lengths)} lengths, over the limit of "
                         f"{MAX_SEQUENCES}; schedule one global batch at a time")
    try:
        return [parse_int(v, f"lengths[{i}]", minimum=1, maximum=MAX_SEQ_LENGTH, text=False)
                for i, v in enumerate(lengths)]
    except CPConfigError as err:
        raise UsageError(f"--lengths {path!r}: {err.violations[0]}") from None


_TWO_LINK_FLAGS = ("gpus_per_node", "intra_gbps", "inter_gbps", "intra_latency_us",
                   "inter_latency_us")


def _schedule_check(args: argparse.Namespace) -> list[int]:
    """The schedule input, the link dialect (one link or two classes), the HCP sizes, the
    head counts and the ``--plot`` path."""
    args.plot_path = _output_file(args.plot) if args.plot is not None else None
    lengths = _read_lengths(args.lengths)
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
    from .config import CPConfig, CPConfigError

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
        raise UsageError(_one_line(err)) from None
    return sizes[0]


def _output_file(path: str) -> Path:
    from .atomic_write import OutputPathError, check_output_file

    try:
        return check_output_file(path, "--plot")
    except OutputPathError as err:
        raise UsageError(str(err)) from None


def _levels(size: int, a2a_size: int | None) -> str:
    from .dynamic_cp.projection import dynamic_levels

    if size == 1:
        return "no CP"
    if a2a_size is None:
        return f"p2p {size}"
    a2a, p2p = dynamic_levels(size, a2a_size)
    return f"a2a {a2a}" if p2p == 1 else f"a2a {a2a} x p2p {p2p}"


def _schedule(args: argparse.Namespace) -> int:
    from .dynamic_cp.projection import Cluster, Hardware, dynamic_levels, plan_seconds
    from .dynamic_cp.scheduler import schedule
    from .dynamic_cp.workload import GPTWorkload, ScheduleError

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
        print(f"cannot schedule: {_one_line(err)}", file=sys.stderr)
        return 2
    if args.plot_path is not None:
        from .dynamic_cp.plot import plot_plan

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
            print(f"    group of {len(g.ranks)} ({ranks}) = {_levels(len(g.ranks), a2a_size)}: "
                  f"samples {list(g.samples)}")
    for note in plan.notes:
        print(f"note: {note}")
    return 0


def _plan_check(args: argparse.Namespace) -> Any:
    """Every ``plan`` input read and bounded, the ``--plot`` path checked, before planning."""
    from .planner import command as plan_command

    try:
        return plan_command.check(args)
    except ValueError as err:  # PlanInputError, OutputPathError
        raise UsageError(_one_line(err)) from None


def _load_named_recipe(name: str, allow_env: list[str]) -> tuple[Any, str | None]:
    """A recipe by name, and why it cannot run here (a Bridge recipe without Bridge) or None;
    a missing or invalid recipe is a UsageError."""
    from .config import CPConfigError
    from .functional.bridge_recipe import BridgeRecipe, bridge_available
    from .functional.harness import recipe_dir
    from .functional.recipe import load_recipe

    try:
        recipe = load_recipe(recipe_dir(name), allow_env=allow_env)
    except FileNotFoundError as err:
        raise UsageError(_one_line(err)) from None
    except CPConfigError as err:
        raise UsageError(f"invalid recipe {name!r}: {_one_line(err)}") from None
    return recipe, bridge_available() if isinstance(recipe, BridgeRecipe) else None


def _recipes(args: argparse.Namespace) -> list[Any]:
    """Load (and so validate) every named recipe before anything runs."""
    from .functional.recipe import list_recipes

    names = args.names or (list_recipes() if args.functional_command == "compare" else [])
    if not names:
        raise UsageError("name a recipe (see `megatron-hcp functional list`)")
    recipes = []
    args.skipped = []  # Bridge recipes of `compare` (all recipes) where Bridge is missing
    for name in names:
        recipe, missing = _load_named_recipe(name, args.allow_env)
        if missing and args.names:
            raise UsageError(f"recipe {name!r} trains with Megatron-Bridge's loop and {missing}")
        if missing:
            args.skipped.append(f"{name}: skipped: {missing}")
            continue
        recipes.append(recipe)
    args.launch = _launch(args, recipes)
    _check_goldens(recipes, args.launch.platform,
                   read=args.functional_command in ("run", "compare"))  # update replaces
    if getattr(args, "plot", None):
        from .atomic_write import OutputPathError, check_output_dir

        try:
            check_output_dir(args.plot, "--plot")
        except OutputPathError as err:
            raise UsageError(str(err)) from None
    return recipes


def _check_goldens(recipes: list[Any], platform: str, *, read: bool) -> None:
    """Each recipe's golden file, before any rank starts: where anything is at its path, it
    must be a regular file (not a directory, a FIFO, a broken or looping link) and, with
    ``read`` (run, compare; update-golden replaces a bad one), valid golden values."""
    import os
    import stat

    from .functional.golden import GoldenError, load_golden

    for recipe in recipes:
        path = recipe.golden_path(platform=platform)
        if not os.path.lexists(path):
            continue
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError as err:
            raise UsageError(f"golden values {str(path)!r}: cannot be read ({err.strerror}); "
                             "remove it or make it a file") from None
        if not regular:
            raise UsageError(f"golden values {str(path)!r}: is not a regular file; remove it "
                             f"(`functional update-golden {recipe.name}` writes a new one)")
        if read:
            try:
                load_golden(path)
            except GoldenError as err:
                raise UsageError(_one_line(err)) from None


def _launch(args: argparse.Namespace, recipes: list[Any]) -> Any:
    """The node layout and platform of ``functional run/compare/update-golden``, validated for
    every named recipe."""
    from .functional.launch import Launch, LaunchError, default_platform, require_runnable

    launch = Launch(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port, platform=args.platform or default_platform(),
                    launcher=args.launcher)
    try:
        require_runnable(launch.platform)
        for recipe in recipes:
            launch.validate(recipe.nproc)
    except LaunchError as err:
        raise UsageError(str(err)) from None
    return launch


def _audit_recipes(args: argparse.Namespace) -> list[Any]:
    """``functional audit``: every named recipe loaded and ``--rank`` checked against it."""

    recipes = []
    for name in args.names:
        recipe, missing = _load_named_recipe(name, args.allow_env)
        if missing:
            raise UsageError(f"recipe {name!r} trains with Megatron-Bridge's loop and {missing}")
        if args.rank is not None and args.rank >= recipe.nproc:
            raise UsageError(f"--rank {args.rank}: recipe {name!r} runs on {recipe.nproc} ranks; "
                             f"give a rank in 0..{recipe.nproc - 1}")
        recipes.append(recipe)
    return recipes


def _audit(args: argparse.Namespace) -> int:
    """One line per recipe: clean, or its first device mix (exit 1)."""
    from .functional.audit import audit_recipe

    found = False
    for recipe in args.checked:
        report = audit_recipe(recipe, platform=args.platform)
        print(report.line(args.rank), flush=True)
        found |= report.first(args.rank) is not None
    return 1 if found else 0


def _functional(args: argparse.Namespace) -> int:
    from .functional import harness
    from .functional.golden import GoldenError
    from .functional.recipe import list_recipes

    if args.functional_command == "list":
        from .functional.bridge_recipe import bridge_available
        from .functional.harness import recipe_dir
        from .functional.recipe import load_recipe

        missing = bridge_available()
        for name in list_recipes():
            loop = "BRIDGE" in load_recipe(recipe_dir(name)).args
            note = f"  (Megatron-Bridge's loop; {missing})" if loop and missing else (
                "  (Megatron-Bridge's loop)" if loop else "")
            print(f"{name}{note}")
        return 0
    recipes = args.checked
    for line in getattr(args, "skipped", []):
        print(line)
    try:
        if args.functional_command == "update-golden":
            for recipe in recipes:
                for line in harness.update_golden(recipe, launch=args.launch):
                    print(line)
            return 0
        results = []
        for recipe in recipes:
            print(f"=== {recipe.name}", flush=True)
            result = harness.check_recipe(recipe, steps=args.steps,
                                          cp_invariance=not args.no_cp1, launch=args.launch)
            for line in result.lines:
                print(f"  {line}")
            if args.plot and args.launch.checks_results:
                from .functional.plot import plot_result

                print(f"  plot: {plot_result(result, args.plot)}")
            results.append(result)
    except (harness.RecipeRunError, GoldenError) as err:
        print(str(err), file=sys.stderr)
        return 1
    print()
    print(harness.summary_table(results))
    return 0 if all(r.passed for r in results) else 1


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's node flags and the platform (golden file and backend)."""
    from .config import MAX_RANKS
    from .functional.launch import LAUNCHERS, PLATFORMS

    p.add_argument("--nnodes", type=_typed("int", minimum=1, maximum=MAX_RANKS), default=1)
    p.add_argument("--node-rank", type=_typed("int", minimum=0, maximum=MAX_RANKS), default=0)
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address (default 127.0.0.1: one node)")
    p.add_argument("--master-port", type=_typed("int", minimum=1, maximum=65535), default=None,
                   help="rendezvous port (default: a free port; required with --nnodes > 1)")
    p.add_argument("--platform", choices=list(PLATFORMS), default=None,
                   help="golden file golden_values_dev_<platform>.json and backend (default: "
                        "the detected one where the trainer runs on it, else cpu_gloo)")
    p.add_argument("--launcher", choices=list(LAUNCHERS), default="torchrun",
                   help="torchrun (default: fresh interpreters, any node layout) or forkserver "
                        "(one CPU node: ranks forked after torch and megatron-core are imported "
                        "once, several times faster for short runs)")


class _Sizes(argparse.Action):
    """``--hierarchical-context-parallel-sizes 2 2`` (megatron) or ``2,2`` / ``[2,2]``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for value in values for v in value] or None)


def _parallel_flags(p: argparse.ArgumentParser, size: Callable[[str], Any], *, tp: int,
                    cp: int) -> None:
    """The parallel sizes of a CP setup under megatron's flag names (short aliases kept)."""
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=size, default=tp)
    p.add_argument("--context-parallel-size", "--cp", dest="cp", type=size, default=cp)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=size, default=1)
    p.add_argument("--hierarchical-context-parallel-sizes", "--hcp", dest="hcp", nargs="+",
                   action=_Sizes, default=None, metavar="SIZE",
                   type=_typed("sizes", "--hierarchical-context-parallel-sizes"),
                   help="the a2a and p2p level sizes: 2 2 (or 2,2)")


# the schedule command's DPxCP group: its cost grows with the ranks (an aligned-block sweep per
# micro-batch); measured with 65536 sequences: 16384 ranks 52 s, 131072 ranks 88-100 s
SCHEDULE_MAX_DP_CP = 16384


def build_parser() -> argparse.ArgumentParser:
    from .config import CP_COMM_TYPES, CP_PARTITION_MODES, LIMITS, MAX_RANKS, MAX_STEPS
    from .planner import command as plan_command

    parser = _Parser(prog="megatron-hcp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    size = _typed("size")

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
    _parallel_flags(p, size, tp=1, cp=1)
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=size, default=1)
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_layout, check=_parallel_layout)

    p = sub.add_parser(
        "verify-groups", help="build megatron's (H)CP groups on local gloo ranks and verify them"
    )
    p.add_argument("--world-size", type=_typed("int", minimum=1, maximum=MAX_LOCAL_RANKS),
                   default=8, help=f"local ranks (at most {MAX_LOCAL_RANKS})")
    _parallel_flags(p, size, tp=2, cp=4)
    p.add_argument("--cp-comm-type", default=None, choices=list(CP_COMM_TYPES),
                   help="default: a2a+p2p with hierarchical sizes, else megatron's p2p")
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.set_defaults(func=_verify_groups, check=_verify_kwargs)

    p = sub.add_parser("schedule", help="plan dynamic-CP micro-batches for a global batch")
    p.add_argument("--dp-cp", type=_typed("int", "--dp-cp", minimum=1,
                                          maximum=SCHEDULE_MAX_DP_CP), required=True,
                   help=f"ranks of the DPxCP group (at most {SCHEDULE_MAX_DP_CP}: "
                        "benchmarks/input_limits.py)")
    p.add_argument("--max-seqlen-per-rank", type=_typed("seqlen", "--max-seqlen-per-rank"),
                   required=True)
    p.add_argument("--min-cp-size", type=size, default=1)
    p.add_argument("--vpp", type=_typed("int", minimum=1, maximum=1024), default=1)
    p.add_argument("--cost", choices=["flops", "seq_squared"], default="flops")
    p.add_argument("--hidden", type=_typed("width", "--hidden"), default=4096)
    p.add_argument("--layers", type=_typed("int", "--layers", minimum=0,
                                           maximum=LIMITS["layers"]), default=1)
    p.add_argument("--heads", type=_typed("heads", "--heads"), default=32)
    p.add_argument("--kv-heads", type=_typed("heads", "--kv-heads"), default=None)
    p.add_argument("--ffn", type=_typed("width", "--ffn"), default=None)
    p.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (3 matmuls)")
    p.add_argument("--window", type=_typed("seqlen", "--window"), default=None,
                   help="causal sliding window of this many tokens back (megatron's "
                        "--window-size W 0)")
    p.add_argument("--cp-partition-mode", choices=list(CP_PARTITION_MODES),
                   default=CP_PARTITION_MODES[0],
                   help="the layout the groups cut sequences in: its padding for the cap, "
                        "and contiguous slices' causal imbalance (the last rank's share)")
    p.add_argument("--link-gbps", type=_typed("float", above=0.0, maximum=1e6), default=None,
                   help="rank plans by projected step time on ONE link for every group: GB/s "
                        "(with --tflops, --link-latency-us); default: FLOPs makespan")
    latency = _typed("float", minimum=0.0, maximum=1e6)
    p.add_argument("--link-latency-us", type=latency, default=None,
                   help="with --link-gbps (default 10)")
    p.add_argument("--tflops", type=_typed("float", above=0.0, maximum=1e6), default=400.0,
                   help="achieved TFLOP/s per rank")
    two = p.add_argument_group(
        "two link classes (the planner's flags; any of them ranks by projected step time on a "
        "node / across nodes; defaults: H100 SXM nodes as in `megatron-hcp plan`)")
    two.add_argument("--gpus-per-node", type=size, default=None,
                     help="ranks per node (default 8); the ranks are DPxCP ranks of TP 1 - "
                          "with TP > 1 give GPUs per node / TP")
    two.add_argument("--intra-gbps", type=_typed("float", above=0.0, maximum=1e6), default=None,
                     help="GB/s per GPU inside a node (default 450)")
    two.add_argument("--inter-gbps", type=_typed("float", above=0.0, maximum=1e6), default=None,
                     help="GB/s per GPU across nodes (default 50)")
    two.add_argument("--intra-latency-us", type=latency, default=None,
                     help="default 5")
    two.add_argument("--inter-latency-us", type=latency, default=None,
                     help="default 10")
    two.add_argument("--hierarchical-context-parallel-sizes", "--hcp", dest="hcp", nargs="+",
                     action=_Sizes, default=None, metavar="SIZE",
                     type=_typed("sizes", "--hierarchical-context-parallel-sizes"),
                     help="dynamic hierarchical CP [a2a, p2p]: a group of c ranks runs a2a "
                          "over min(c, a2a) and a p2p ring over the rest (implies two link "
                          "classes)")
    p.add_argument("--lengths", required=True, help="JSON file: a list of sequence lengths")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a Gantt chart (PNG)")
    p.set_defaults(func=_schedule, check=_schedule_check)

    p = sub.add_parser("plan", help="rank TP/CP/PP/DP, cp_comm_type, HCP sizes and dynamic-CP "
                                    "knobs for a model on a cluster (projected step time, memory)")
    plan_command.add_arguments(p)
    p.set_defaults(func=plan_command.run, check=_plan_check)

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
        p.add_argument("--lock-timeout", type=_typed("float", minimum=0.0, maximum=3600.0),
                       default=10.0, metavar="SECONDS",
                       help="wait this long for another patch process on the same target "
                            "(default 10), then refuse naming it")
        p.set_defaults(func=_patch_fork, check=_patch_target)

    fn = sub.add_parser("functional", help="functional recipes with golden values (CPU/gloo)")
    fn_sub = fn.add_subparsers(dest="functional_command", required=True)
    p = fn_sub.add_parser("list", help="the recipes")
    p.set_defaults(func=_functional)
    allow_env = dict(action="append", default=[], metavar="NAME",
                     help="let the recipe's ENV_VARS set this loader variable (e.g. LD_PRELOAD)")
    for cmd, text in (("run", "run recipes and compare them (golden values, CP=1)"),
                      ("compare", "run and compare every recipe (or the named ones)")):
        p = fn_sub.add_parser(cmd, help=text)
        p.add_argument("names", nargs="*")
        p.add_argument("--steps", type=_typed("int", minimum=1, maximum=MAX_STEPS),
                       default=None, help="train this many steps")
        p.add_argument("--no-cp1", action="store_true", help="skip the CP=1 invariance run")
        p.add_argument("--plot", default=None, metavar="DIR",
                       help="write DIR/<recipe>.png: lm loss of the run, golden values, CP=1 "
                            "run and the resume point")
        p.add_argument("--allow-env", **allow_env)
        _launch_arguments(p)
        p.set_defaults(func=_functional, check=_recipes)
    p = fn_sub.add_parser(
        "audit", help="device audit: one training step of each recipe's GPU run on emulated "
        "CUDA devices (CPU only); prints the first op that mixes devices, with its file:line")
    p.add_argument("names", nargs="+")
    p.add_argument("--rank", type=_typed("int", minimum=0, maximum=MAX_RANKS), default=None,
                   help="report this rank's findings (every rank runs; default: the first "
                        "finding of any rank)")
    p.add_argument("--platform", choices=["gpu_nccl", "cpu_gloo"], default="gpu_nccl",
                   help="gpu_nccl (default): the GPU run, device mixes; cpu_gloo: the CPU run "
                        "on a machine with CUDA, which must never use CUDA")
    p.add_argument("--allow-env", **allow_env)
    p.set_defaults(func=_audit, check=_audit_recipes)
    p = fn_sub.add_parser("update-golden", help="regenerate golden values; say what changed")
    p.add_argument("names", nargs="+")
    p.add_argument("--allow-env", **allow_env)
    _launch_arguments(p)
    p.set_defaults(func=_functional, check=_recipes)
    return parser


def parse_and_check(argv: Sequence[str] | None = None) -> argparse.Namespace | int:
    """Parse ``argv`` and run the command's input checks (nothing is started).

    Returns the namespace (``checked`` holds what the checks produced), or the exit code
    (2: bad input, already reported on one line; 0: ``--help``).
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse: --help (0) or a usage error (2, one line printed)
        return stop.code if isinstance(stop.code, int) else 2
    check = getattr(args, "check", None)
    try:
        args.checked = check(args) if check is not None else None
    except UsageError as err:
        print(f"megatron-hcp {args.command}: error: {err}", file=sys.stderr)
        return 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; bad input exits 2 with one line on stderr, never a traceback;
    Ctrl-C exits 130 with one line."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parse_and_check(argv)
        if isinstance(args, int):
            return args
        try:
            return args.func(args)
        except UsageError as err:
            print(f"megatron-hcp {args.command}: error: {err}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        print("megatron-hcp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
