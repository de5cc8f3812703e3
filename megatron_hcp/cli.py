"""``megatron-hcp`` command line: a dispatcher.

Each subcommand lives in the package whose work it runs (``<package>/command.py``): it registers
its arguments (``add_parsers``), reads and validates its input before anything starts
(``check``) and runs (``func``). What they share - the usage error, one-line argparse errors,
typed arguments, the lengths reader - is :mod:`megatron_hcp.command_line`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence

from .command_line import NamedStream, Parser, UsageError, one_line
from .dynamic_cp.command import SCHEDULE_MAX_DP_CP  # noqa: F401 - its old home
from .files.atomic_write import OutputPathError, OutputWriteError
from .functional.signals import Terminated
from .parallel_state.command import MAX_LOCAL_RANKS  # noqa: F401 - its old home

__all__ = ["SCHEDULE_MAX_DP_CP", "UsageError", "build_parser", "main", "parse_and_check"]


def _bridge_patch_sets():
    """Megatron-Bridge's patches for ``patch list`` (the patching package sits below Bridge)."""
    from .bridge.cpu_runtime import BRIDGE_CPU_RUNTIME_PATCHES, BRIDGE_RUNTIME_PATCHES
    from .bridge.hook import BRIDGE_LOOP_PATCHES, BRIDGE_PATCHES

    return [("megatron-bridge", BRIDGE_PATCHES + BRIDGE_LOOP_PATCHES + BRIDGE_RUNTIME_PATCHES
             + BRIDGE_CPU_RUNTIME_PATCHES)]


def build_parser() -> argparse.ArgumentParser:
    from .dynamic_cp import command as schedule_command
    from .functional import command as functional_command
    from .parallel_state import command as setup_command
    from .patching import command as patch_command
    from .planner import command as plan_command

    parser = Parser(prog="megatron-hcp", description="context parallelism for megatron-core: "
                    "check a CP setup, print its layout, verify its groups, schedule dynamic CP, "
                    "plan a cluster, manage the patches, run the functional recipes")
    sub = parser.add_subparsers(dest="command", required=True)
    setup_command.add_parsers(sub)  # check-config, layout, verify-groups
    schedule_command.add_parsers(sub)
    plan_command.add_parsers(sub)
    patch_command.add_parsers(sub, _bridge_patch_sets)
    functional_command.add_parsers(sub)
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
    Ctrl-C exits 130 with one line, SIGTERM or SIGHUP during a recipe run 128 + the signal's
    number (the run's launcher and ranks ended first: :mod:`megatron_hcp.functional.signals`);
    an output the file system refuses (full, over quota, read-only; the standard output too,
    e.g. ``> /dev/full``) exits 1 with one line naming it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stdout = sys.stdout
    sys.stdout = NamedStream(stdout, "the standard output")
    try:
        return _main(argv)
    finally:
        sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    command = "megatron-hcp"
    try:
        args = parse_and_check(argv)
        if isinstance(args, int):
            return args
        command = f"megatron-hcp {args.command}"
        try:
            code = args.func(args)
            sys.stdout.flush()  # a refused output fails here, not at the interpreter's exit
            return code
        except UsageError as err:
            print(f"{command}: error: {err}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        print("megatron-hcp: interrupted", file=sys.stderr)
        return 130
    except Terminated as err:  # SIGTERM/SIGHUP during a run, which has ended: 128 + signal
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"megatron-hcp: {err}; the run's processes and temporary files are gone",
                  file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        _discard_stdout()
        return 141
    except (OutputWriteError, OutputPathError) as err:  # full, read-only: named, one line
        if isinstance(err, OutputWriteError) and err.filename == "the standard output":
            _discard_stdout()
        print(f"{command}: error: {one_line(err)}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """What is left in the standard output's buffer goes nowhere (its reader or its disk is
    gone), so that the interpreter's last flush does not fail again."""
    import os

    with contextlib.suppress(OSError, ValueError):  # no file descriptor (a test's capture)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
