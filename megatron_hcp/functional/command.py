"""``megatron-hcp functional list | run | compare | audit | update-golden``: the functional
recipes trained and compared with their golden values and CP=1, and their device audit."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..command_line import UsageError, one_line, typed

__all__ = ["add_parsers"]


def _load_named_recipe(name: str, args: argparse.Namespace) -> tuple[Any, str | None]:
    """A recipe by name, and why it cannot run here (a Bridge recipe without Bridge) or None;
    a missing or invalid recipe is a UsageError."""
    from ..config import CPConfigError
    from .bridge_recipe import BridgeRecipe, bridge_available
    from .harness import recipe_dir
    from .recipe import load_recipe

    try:
        recipe = load_recipe(recipe_dir(name), allow_env=args.allow_env,
                             allow_recipe_modules=args.allow_recipe_module)
    except FileNotFoundError as err:
        raise UsageError(one_line(err)) from None
    except CPConfigError as err:
        raise UsageError(f"invalid recipe {name!r}: {one_line(err)}") from None
    return recipe, bridge_available() if isinstance(recipe, BridgeRecipe) else None


def _recipes(args: argparse.Namespace) -> list[Any]:
    """Load (and so validate) every named recipe before anything runs."""
    from .recipe import list_recipes

    names = args.names or (list_recipes() if args.functional_command == "compare" else [])
    if not names:
        raise UsageError("name a recipe (see `megatron-hcp functional list`)")
    recipes = []
    args.skipped = []  # Bridge recipes of `compare` (all recipes) where Bridge is missing
    for name in names:
        recipe, missing = _load_named_recipe(name, args)
        if missing and args.names:
            raise UsageError(f"recipe {name!r} trains with Megatron-Bridge's loop and {missing}")
        if missing:
            args.skipped.append(f"{name}: skipped: {missing}")
            continue
        recipes.append(recipe)
    args.launch = _launch(args, recipes)
    _preflight(recipes, args.launch.platform, args.launch.nnodes)
    _check_goldens(recipes, args.launch.platform,
                   read=args.functional_command in ("run", "compare"))  # update replaces
    if getattr(args, "plot", None):
        from ..files.atomic_write import OutputPathError, check_output_dir

        try:
            check_output_dir(args.plot, "--plot")
        except OutputPathError as err:
            raise UsageError(str(err)) from None
    return recipes


def _preflight(recipes: list[Any], platform: str, nnodes: int = 1) -> None:
    """What every rank would find only after starting (:mod:`.preflight`): the switches in
    this environment, and each ``MODEL_ARGS`` recipe's memory on this node (CPU runs)."""
    import os

    from ..config import CPConfigError
    from .preflight import check_memory, rank_environment_problems
    from .recipe import Recipe

    problems = rank_environment_problems(os.environ, "the environment")
    if problems:
        raise UsageError(one_line(CPConfigError(problems)))
    for recipe in recipes:
        if isinstance(recipe, Recipe) and platform == "cpu_gloo":
            try:
                check_memory(recipe, recipe.nproc // nnodes)
            except CPConfigError as err:
                raise UsageError(one_line(err)) from None


def _check_goldens(recipes: list[Any], platform: str, *, read: bool) -> None:
    """Each recipe's golden file, before any rank starts: where anything is at its path, it
    must be a regular file (not a directory, a FIFO, a broken or looping link) and, with
    ``read`` (run, compare; update-golden replaces a bad one), valid golden values."""
    import os
    import stat

    from .golden import GoldenError, load_golden

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
                raise UsageError(one_line(err)) from None


def _launch(args: argparse.Namespace, recipes: list[Any]) -> Any:
    """The node layout and platform of ``functional run/compare/update-golden``, validated for
    every named recipe."""
    from .launch import Launch, LaunchError, default_platform, require_runnable

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
        recipe, missing = _load_named_recipe(name, args)
        if missing:
            raise UsageError(f"recipe {name!r} trains with Megatron-Bridge's loop and {missing}")
        if args.rank is not None and args.rank >= recipe.nproc:
            raise UsageError(f"--rank {args.rank}: recipe {name!r} runs on {recipe.nproc} ranks; "
                             f"give a rank in 0..{recipe.nproc - 1}")
        recipes.append(recipe)
    _preflight(recipes, args.platform)  # the audit's ranks run on this CPU machine
    return recipes


def _audit(args: argparse.Namespace) -> int:
    """One line per recipe: clean, or its first device mix (exit 1)."""
    from .audit import audit_recipe

    found = False
    for recipe in args.checked:
        report = audit_recipe(recipe, platform=args.platform)
        print(report.line(args.rank), flush=True)
        found |= report.first(args.rank) is not None
    return 1 if found else 0


def _functional(args: argparse.Namespace) -> int:
    from . import harness
    from .golden import GoldenError
    from .recipe import list_recipes

    if args.functional_command == "list":
        from .bridge_recipe import bridge_available
        from .harness import recipe_dir
        from .recipe import load_recipe

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
                from .plot import plot_result

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
    from ..config import MAX_RANKS
    from .launch import LAUNCHERS, PLATFORMS

    p.add_argument("--nnodes", type=typed("int", minimum=1, maximum=MAX_RANKS), default=1)
    p.add_argument("--node-rank", type=typed("int", minimum=0, maximum=MAX_RANKS), default=0)
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address (default 127.0.0.1: one node)")
    p.add_argument("--master-port", type=typed("int", minimum=1, maximum=65535), default=None,
                   help="rendezvous port (default: a free port; required with --nnodes > 1)")
    p.add_argument("--platform", choices=list(PLATFORMS), default=None,
                   help="golden file golden_values_dev_<platform>.json and backend (default: "
                        "the detected one where the trainer runs on it, else cpu_gloo)")
    p.add_argument("--launcher", choices=list(LAUNCHERS), default="torchrun",
                   help="torchrun (default: fresh interpreters, any node layout) or forkserver "
                        "(one CPU node: ranks forked after torch and megatron-core are imported "
                        "once, several times faster for short runs)")


def add_parsers(sub: Any) -> None:
    """Register functional and its subcommands."""
    from ..config import MAX_RANKS, MAX_STEPS

    fn = sub.add_parser("functional", help="functional recipes with golden values (CPU/gloo)")
    fn_sub = fn.add_subparsers(dest="functional_command", required=True)
    p = fn_sub.add_parser("list", help="the recipes")
    p.set_defaults(func=_functional)
    from .allowances import add_arguments
    for cmd, text in (("run", "run recipes and compare them (golden values, CP=1)"),
                      ("compare", "run and compare every recipe (or the named ones)")):
        p = fn_sub.add_parser(cmd, help=text)
        p.add_argument("names", nargs="*")
        p.add_argument("--steps", type=typed("int", minimum=1, maximum=MAX_STEPS),
                       default=None, help="train this many steps")
        p.add_argument("--no-cp1", action="store_true", help="skip the CP=1 invariance run")
        p.add_argument("--plot", default=None, metavar="DIR",
                       help="write DIR/<recipe>.png: lm loss of the run, golden values, CP=1 "
                            "run and the resume point")
        add_arguments(p)
        _launch_arguments(p)
        p.set_defaults(func=_functional, check=_recipes)
    p = fn_sub.add_parser(
        "audit", help="device audit: one training step of each recipe's GPU run on emulated "
        "CUDA devices (CPU only); prints the first op that mixes devices, with its file:line")
    p.add_argument("names", nargs="+")
    p.add_argument("--rank", type=typed("int", minimum=0, maximum=MAX_RANKS), default=None,
                   help="report this rank's findings (every rank runs; default: the first "
                        "finding of any rank)")
    p.add_argument("--platform", choices=["gpu_nccl", "cpu_gloo"], default="gpu_nccl",
                   help="gpu_nccl (default): the GPU run, device mixes; cpu_gloo: the CPU run "
                        "on a machine with CUDA, which must never use CUDA")
    add_arguments(p)
    p.set_defaults(func=_audit, check=_audit_recipes)
    p = fn_sub.add_parser("update-golden", help="regenerate golden values; say what changed")
    p.add_argument("names", nargs="+")
    add_arguments(p)
    _launch_arguments(p)
    p.set_defaults(func=_functional, check=_recipes)
