"""megatron's command-line flags, the one dialect of a CP setup, read into typed field values.

``--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2
--dynamic-context-parallel`` (recipes' ``MODEL_ARGS``, the CLI); ``key=value`` and
``--key=value`` are thin aliases. :meth:`CPConfig.from_args <.rules.CPConfig.from_args>` and
``from_pairs`` build on :func:`read_flags` and :func:`check_pairs`. Each value is read by
:func:`~.values.parse_value` with its field's kind (:data:`~.values.FIELD_KINDS`). Below the CP
rules: it imports only :mod:`.errors` and :mod:`.values`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import CPConfigError, Violation
from .values import FIELD_KINDS, parse_value

__all__ = ["check_pairs", "read_flags"]


def check_pairs(pairs: Sequence[str]) -> None:
    """Refuse every argument of ``pairs`` that is not ``key=value`` (one :class:`CPConfigError`
    listing them)."""
    problems = [Violation(pair, None, "arguments are key=value",
                          "write e.g. seq_length=4096") for pair in pairs if "=" not in pair]
    if problems:
        raise CPConfigError(problems)


def read_flags(args: Sequence[str], known: Sequence[str]) -> dict[str, Any]:
    """The values of megatron flags ``args`` for the fields ``known`` (keyword arguments of the
    config). A bare flag of a boolean field is true; list fields take several values (or
    ``[2,2]``, ``2,2``); ``key=value`` / ``--key=value`` are thin aliases. Every bad argument is
    reported at once, in one :class:`CPConfigError`.
    """
    problems: list[Violation] = []
    given: dict[str, list[str]] = {}
    current: str | None = None
    for arg in args:
        text = str(arg)
        flag, sep, inline = text.partition("=")
        if text.startswith("--") or (sep and not text.startswith("-")):
            key = flag.lstrip("-").strip().replace("-", "_")
            if key not in known:
                problems.append(Violation(flag, inline or None, "unknown parameter",
                                          "use one of " + ", ".join(
                                              f"--{k.replace('_', '-')}" for k in known)))
                current = None
                continue
            given[key] = [inline] if sep else []
            current = None if sep else key
        elif current is not None:
            given[current].append(text)
        else:
            problems.append(Violation(text, None, "a value without a flag",
                                      "write --flag value (e.g. --context-parallel-size 4)"))
    kwargs: dict[str, Any] = {}
    for key, values in given.items():
        kind = FIELD_KINDS[key]
        try:
            if not values:
                if kind.lstrip("?") != "bool":
                    raise CPConfigError([Violation(
                        f"--{key.replace('_', '-')}", None, "needs a value",
                        f"write --{key.replace('_', '-')} <value>")])
                kwargs[key] = True
            elif kind.lstrip("?") in ("sizes", "strs", "window") and len(values) > 1:
                kwargs[key] = parse_value(",".join(values), kind, key)
            elif len(values) > 1:
                raise CPConfigError([Violation(
                    f"--{key.replace('_', '-')}", values, "takes one value",
                    f"write --{key.replace('_', '-')} <value>")])
            else:
                kwargs[key] = parse_value(values[0], kind, key)
        except CPConfigError as err:
            problems.extend(err.violations)
    if problems:
        raise CPConfigError(problems)
    return kwargs
