"""A per-rank check of the MPU path: build the groups, all-reduce rank ids over each of them."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..config import CPConfig
from .groups import collective_device
from .mpu import destroy_model_parallel, initialize_model_parallel
from .report import describe_cp_groups

__all__ = ["check_mpu_groups"]


def check_mpu_groups(config_kwargs: dict[str, Any], order: str = "tp-cp-ep-dp-pp") -> dict:
    """Initialize megatron's groups from ``config_kwargs`` and verify them with collectives.

    Returns, for this rank, the log lines and for every group (cp and each HCP level) the
    all-reduced sum of member ranks next to the sum expected from the layout.
    """
    logging.getLogger("megatron_hcp").setLevel(logging.INFO)
    from megatron.core import parallel_state as ps

    config = CPConfig(**config_kwargs)
    layout = initialize_model_parallel(config, order=order, create_gloo_process_groups=False)
    try:
        rank = dist.get_rank()
        groups = {"cp": ps.get_context_parallel_group()}
        if layout.hcp:
            for level, g in enumerate(ps.get_hierarchical_context_parallel_groups()):
                groups[f"hcp level {level}"] = g
        expected = {"cp": layout.group_of("cp", rank)}
        for level, members in enumerate(layout.hcp_of(rank)):
            expected[f"hcp level {level}"] = members
        checks = {}
        for name, group in groups.items():
            value = torch.tensor([rank], dtype=torch.int64, device=collective_device(group))
            dist.all_reduce(value, group=group)
            checks[name] = (int(value), sum(expected[name]), expected[name])
        return {"lines": describe_cp_groups(layout), "checks": checks}
    finally:
        destroy_model_parallel()
