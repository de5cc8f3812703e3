"""The one error vocabulary of every input check: a :class:`Violation` (parameter, value, rule,
fix) and :class:`CPConfigError`, which lists every violation at once.

The lowest module of :mod:`megatron_hcp.config`: it imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BRIEF", "CPConfigError", "Violation", "brief", "closest"]


@dataclass(frozen=True)
class Violation:
    """One broken rule: which parameter, its value, the rule, and how to fix it."""

    parameter: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        name = str(self.parameter)
        name = name if len(name) <= BRIEF else f"{name[:BRIEF - 22]}... ({len(name)} characters)"
        return f"{name}={brief(self.value)}: {self.rule}. Fix: {self.fix}."


BRIEF = 80  # characters of a value an error quotes


def brief(value: Any, limit: int = BRIEF) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error never floods with a bad value."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond Python's int-to-text limit
        return "<an integer of over 4000 digits>"
    return text if len(text) <= limit else f"{text[:limit - 22]}... ({len(text)} characters)"


def closest(name: Any, choices: Sequence[str]) -> str:
    """The fix for an unknown name: the valid one closest to it (in any case), else the list."""
    import difflib

    folded = {choice.lower(): choice for choice in choices}
    text = str(name)[:BRIEF].lower()
    hits = difflib.get_close_matches(text, list(folded), n=1, cutoff=0.6)
    listed = ", ".join(choices)
    return f"did you mean {folded[hits[0]]}? (one of {listed})" if hits else (
        f"use one of {listed}")


class CPConfigError(ValueError):
    """Raised by :meth:`CPConfig.validate`; ``violations`` lists every broken rule."""

    def __init__(self, violations: Sequence[Violation]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"invalid context-parallel configuration:\n{lines}")

