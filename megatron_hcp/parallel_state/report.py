"""The log lines that tell which CP groups are active (pure; shared by MPU and bridge paths)."""

from __future__ import annotations

import json

from ..config.topology import Groups, Topology

__all__ = ["describe_cp_groups"]

_LEVEL_NAMES = ("a2a", "p2p")


def _fmt(groups: Groups) -> str:
    return json.dumps(groups, separators=(",", ":"))


def describe_cp_groups(layout: Topology) -> list[str]:
    """``CONTEXT_PARALLEL_GROUP created: ...`` and, with HCP, the per-level line.

    Users grep for ``HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``: it is present only when the
    hierarchical levels were really created.
    """
    lines = [f"CONTEXT_PARALLEL_GROUP created: cp={layout.cp} {_fmt(layout.groups['cp'])}"]
    if layout.hcp:
        parts = []
        for level, groups in enumerate(layout.hcp):
            name = _LEVEL_NAMES[level] if level < len(_LEVEL_NAMES) else "level"
            parts.append(f"{name}(level {level})={len(groups[0])} {_fmt(groups)}")
        head = f"HIERARCHICAL_CONTEXT_PARALLEL_GROUPS created: cp={layout.cp}"
        lines.append(" ".join([head, *parts]))
    return lines
