"""What every ``megatron-hcp`` subcommand shares: its error, its parser, typed arguments, one
lengths reader and the output-file check.

Each subcommand lives in the package whose work it runs (``<package>/command.py``: an
``add_parsers(sub)`` that registers it, a ``check`` that reads and validates its input before
anything starts, a ``run``); :mod:`megatron_hcp.cli` only dispatches.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["NamedStream", "Parser", "Sizes", "UsageError", "one_line", "output_file",
           "read_lengths", "typed"]


class UsageError(ValueError):
    """Bad command-line input found before anything runs (exit 2, one line)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class Sizes(argparse.Action):
    """``--hierarchical-context-parallel-sizes 2 2`` (megatron) or ``2,2`` / ``[2,2]``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for value in values for v in value] or None)


def typed(kind: str, name: str = "the value", **bounds: Any) -> Callable[[str], Any]:
    """An argparse ``type`` that reads the value with the one strict parser (config.values)."""
    from .config import argument_type

    return argument_type(kind, name, **bounds)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def output_file(path: str, flag: str = "--plot") -> Path:
    """``path`` checked as a file the command may write (its folder exists, it is no folder)."""
    from .files.atomic_write import OutputPathError, check_output_file

    try:
        return check_output_file(path, flag)
    except OutputPathError as err:
        raise UsageError(str(err)) from None


class NamedStream:
    """A text stream (the command's standard output) whose refused writes - a full file system,
    ``> /dev/full``, a read-only disk - raise :class:`~.files.atomic_write.OutputWriteError` naming
    it, from ``write`` and ``flush`` alike; everything else is the stream's own."""

    def __init__(self, stream: Any, name: str) -> None:
        self.stream, self.name = stream, name

    def write(self, text: str) -> int:
        from .files.atomic_write import naming_write_errors

        with naming_write_errors(self.name):
            return self.stream.write(text)

    def flush(self) -> None:
        from .files.atomic_write import naming_write_errors

        with naming_write_errors(self.name):
            self.stream.flush()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.stream, attr)


def read_lengths(path: str, flag: str = "--lengths") -> list[int]:
    """The one reader of a global batch's sequence lengths: a non-empty JSON list of at most
    ``MAX_SEQUENCES`` integers, each in 1..``MAX_SEQ_LENGTH`` (bounded reader; nothing
    coerced: ``2.5``, ``"7"`` and ``true`` are not lengths)."""
    from .config import MAX_SEQ_LENGTH, MAX_SEQUENCES, CPConfigError, parse_int
    from .files.bounded_read import InputFileError, read_json

    try:
        lengths = read_json(path, flag)
    except InputFileError as err:
        raise UsageError(one_line(err)) from None
    if not isinstance(lengths, list) or not lengths:
        got = "an empty list" if isinstance(lengths, list) else type(lengths).__name__
        raise UsageError(f"{flag} {path!r} must hold a non-empty JSON list of sequence lengths, "
                         f"got {got}; write one global batch's lengths, e.g. [4096, 812]")
    if len(lengths) > MAX_SEQUENCES:
        raise UsageError(f"{flag} {path!r} holds {len(lengths)} lengths, over the limit of "
                         f"{MAX_SEQUENCES} sequences per global batch; give one global batch")
    try:
        return [parse_int(v, f"lengths[{i}]", minimum=1, maximum=MAX_SEQ_LENGTH, text=False)
                for i, v in enumerate(lengths)]
    except CPConfigError as err:
        raise UsageError(f"{flag} {path!r}: {err.violations[0]}") from None
