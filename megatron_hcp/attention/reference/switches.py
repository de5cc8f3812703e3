"""The attention's switches (``MEGATRON_HCP_FUSED_OPS``, ``MEGATRON_HCP_SPLIT_PACKED``): an
environment variable read at every use, and a choice for the code a ``with`` block wraps.

The choice is a context variable, not a write to the environment: rank threads of one
process (``tests/gpu``, ``ThreadedWorld``) each choose without racing on the process's
``os.environ``. A thread the choosing code did not start (the autograd engine's on CUDA) does
not see it and reads the environment variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

from ...config.errors import brief
from .seq_layout import CPAttentionError

__all__ = ["Switch"]


class Switch:
    """One switch, ``name`` in errors: ``variable`` takes one of ``modes`` (the first is the
    default), each meaning what ``choices`` says (for the error a bad value gets)."""

    def __init__(self, name: str, variable: str, modes: tuple[str, ...], choices: str) -> None:
        self.name, self.variable, self.modes, self.choices = name, variable, modes, choices
        self._chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            variable, default=None)

    def mode(self) -> str:
        """The mode :meth:`chosen` set here, else the environment variable's (default: the
        first mode) in any case and spacing; another value is refused naming the variable,
        its value, the choices and that unsetting it gives the default."""
        chosen = self._chosen.get()
        if chosen is not None:
            return chosen
        value = os.environ.get(self.variable, self.modes[0])
        mode = value.strip().lower()
        if mode not in self.modes:
            raise CPAttentionError(f"{self.variable}={brief(value)}: use {self.choices}; unset "
                                   f"it for {self.modes[0]}")
        return mode

    @contextlib.contextmanager
    def chosen(self, mode: str) -> Iterator[None]:
        """``mode`` for the code inside the block, in this thread, over the environment
        variable (the benchmarks measure both ways in one run)."""
        choice = mode.strip().lower()  # as the environment variable is read
        if choice not in self.modes:
            raise CPAttentionError(f"{self.name} mode {brief(mode)}: use one of "
                                   f"{', '.join(self.modes)} ({self.variable})")
        token = self._chosen.set(choice)
        try:
            yield
        finally:
            self._chosen.reset(token)
