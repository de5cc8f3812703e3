"""The attention's environment switches (``MEGATRON_HCP_FUSED_OPS``,
``MEGATRON_HCP_SPLIT_PACKED``): read at every use, checked alike."""

from __future__ import annotations

import os

from .seq_layout import CPAttentionError

__all__ = ["env_mode"]


def env_mode(variable: str, modes: tuple[str, ...], choices: str) -> str:
    """The mode the environment variable ``variable`` sets (default: the first of ``modes``),
    in any case and spacing; another value is refused naming the variable, its value, the
    ``choices`` (each mode and what it does) and that unsetting it gives the default."""
    value = os.environ.get(variable, modes[0])
    mode = value.strip().lower()
    if mode not in modes:
        raise CPAttentionError(f"{variable}={value!r}: use {choices}; unset it for {modes[0]}")
    return mode
