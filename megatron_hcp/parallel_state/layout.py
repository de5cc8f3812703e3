"""Old import path of the rank arithmetic, kept for users' imports.

Every rank list, HCP level and dynamic block is derived by
:class:`megatron_hcp.config.topology.Topology` (what ``CPConfig.resolve`` returns);
``ParallelLayout`` is that class under its old name.
"""

from __future__ import annotations

from ..config.topology import (
    ORDERS,
    Groups,
    Topology,
    dynamic_cp_blocks,
    dynamic_hcp_levels,
    group_containing,
    hierarchical_level_groups,
    orthogonal_groups,
)

ParallelLayout = Topology  # the old name of the one topology

__all__ = [
    "ORDERS",
    "Groups",
    "ParallelLayout",
    "Topology",
    "dynamic_cp_blocks",
    "dynamic_hcp_levels",
    "group_containing",
    "hierarchical_level_groups",
    "orthogonal_groups",
]
