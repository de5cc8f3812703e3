"""``megatron-hcp patch list | check | apply | revert``: the runtime patches and their state, and
the fork-style diffs of ``patches/`` applied to a target tree as transactions."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..command_line import UsageError, one_line, typed

__all__ = ["add_parsers"]

#: (package, its patches) of the clients above this package (Megatron-Bridge's), given by the
#: command line
PatchSets = Callable[[], Sequence[tuple[str, Sequence[Any]]]]


def _patch_list(args: argparse.Namespace, others: PatchSets) -> int:
    from . import ALL_PATCHES, is_applied
    from .registry import installed_version

    for package, patches in (("megatron-core", ALL_PATCHES), *others()):
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
    if not os.path.isdir(args.target):
        raise UsageError(f"--target {args.target!r} is not a directory; give a Megatron-LM "
                         "checkout or an installed megatron package directory")
    return args.target


def _patch_fork(args: argparse.Namespace) -> int:
    """check | apply | revert the fork-style diffs of patches/ on a target tree."""
    from . import PatchError
    from .forkpatch import apply_diffs, check_diffs, revert_diffs

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
        print(f"refused: {one_line(err)}", file=sys.stderr)
        return 2


def add_parsers(sub: Any, others: PatchSets = tuple) -> None:
    """Register patch list / check / apply / revert; ``others``: the patch sets of packages
    above this one, listed after megatron-core's."""
    patch = sub.add_parser("patch", help="runtime patches of megatron-core")
    patch_sub = patch.add_subparsers(dest="patch_command", required=True)
    p = patch_sub.add_parser("list", help="every patch, its upstream versions, applied or not")
    p.add_argument("-v", "--verbose", action="store_true", help="show the upstream lines")
    p.set_defaults(func=functools.partial(_patch_list, others=others))
    for cmd, text in (("check", "each fork-style diff of patches/: applied, applicable or "
                                "conflicts"),
                      ("apply", "apply every diff not yet applied (atomic)"),
                      ("revert", "revert every applied diff (atomic)")):
        p = patch_sub.add_parser(cmd, help=text)
        p.add_argument("--target", required=True,
                       help="a Megatron-LM checkout or an installed megatron package directory")
        p.add_argument("--lock-timeout", type=typed("float", minimum=0.0, maximum=3600.0),
                       default=10.0, metavar="SECONDS",
                       help="wait this long for another patch process on the same target "
                            "(default 10), then refuse naming it")
        p.set_defaults(func=_patch_fork, check=_patch_target)
