"""The one error vocabulary of every input check: a :class:`Violation` (parameter, value, rule,
fix) and :class:`CPConfigError`, which lists every violation at once.

The lowest module of :mod:`megatron_hcp.config`: it imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CPConfigError", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One broken rule: which parameter, its value, the rule, and how to fix it."""

    parameter: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.parameter}={self.value!r}: {self.rule}. Fix: {self.fix}."


class CPConfigError(ValueError):
    """Raised by :meth:`CPConfig.validate`; ``violations`` lists every broken rule."""

    def __init__(self, violations: Sequence[Violation]):
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"invalid context-parallel configuration:\n{lines}")

