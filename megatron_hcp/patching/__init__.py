"""Named, version-gated runtime patches of megatron-core (see ``megatron-hcp patch list``)."""

from __future__ import annotations

from .cpu_runtime import CPU_RUNTIME_PATCHES, apply_cpu_runtime, revert_cpu_runtime
from .integration import INTEGRATION_PATCHES
from .registry import Patch, PatchError, apply, is_applied, megatron_core_version, revert

__all__ = [
    "ALL_PATCHES",
    "CPU_RUNTIME_PATCHES",
    "INTEGRATION_PATCHES",
    "Patch",
    "PatchError",
    "apply",
    "apply_cpu_runtime",
    "by_name",
    "is_applied",
    "megatron_core_version",
    "revert",
    "revert_cpu_runtime",
]

ALL_PATCHES: tuple[Patch, ...] = INTEGRATION_PATCHES + CPU_RUNTIME_PATCHES


def by_name(names: list[str] | None = None) -> list[Patch]:
    """The named patches (all when ``names`` is None); unknown names raise PatchError."""
    if names is None:
        return list(ALL_PATCHES)
    table = {p.name: p for p in ALL_PATCHES}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise PatchError(f"unknown patch(es) {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]
