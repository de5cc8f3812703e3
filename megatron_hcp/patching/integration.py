"""Patches that make megatron-core's own classes honour hierarchical and dynamic CP groups."""

from __future__ import annotations

from dataclasses import fields

from ..attention.module import make_te_forward, make_te_init
from .registry import Patch, Target

__all__ = ["INTEGRATION_PATCHES"]

VERSIONS = ("0.16.1",)
_TE = "megatron.core.extensions.transformer_engine"


def _make_pgc_repr(original):
    def __repr__(self):
        """Which process groups exist and their sizes; a list (``hcp``) shows every level."""
        parts = []
        for f in fields(self):
            if not hasattr(self, f.name):
                continue
            pg = getattr(self, f.name)
            if pg is None:
                parts.append(f"{f.name}(None)")
            elif isinstance(pg, (list, tuple)):
                parts.append(f"{f.name}({[g.size() for g in pg]})")
            else:
                parts.append(f"{f.name}({pg.size()})")
        return f"ProcessGroupCollection({', '.join(parts) or 'empty'})"

    return __repr__


def _make_destroy(original):
    def destroy_model_parallel(*args, **kwargs):
        """Upstream destroy, then forget the hierarchical and hybrid DPxCP CP groups too."""
        from megatron.core import parallel_state as ps

        from ..parallel_state.mpu import forget_cp_groups

        original(*args, **kwargs)
        forget_cp_groups(ps)

    return destroy_model_parallel


INTEGRATION_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="destroy-forgets-cp-groups",
        summary="destroy_model_parallel also clears the hierarchical and hybrid DPxCP groups",
        upstream="megatron/core/parallel_state.py:2085-2234 destroy_model_parallel never resets "
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS (115) or _HYBRID_DP_CP_GROUPS (117)",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.parallel_state", "destroy_model_parallel", _make_destroy),
        ),
    ),
    Patch(
        name="te-attention-hcp",
        summary="TEDotProductAttention: a2a+p2p takes pg_collection.hcp, cp_stream is created "
        "lazily, dynamic CP groups are restored after forward",
        upstream="megatron/core/extensions/transformer_engine.py:1200-1205 default collection, "
        "1232-1233 eager torch.cuda.Stream(), 1248-1250 global "
        "get_hierarchical_context_parallel_groups(), 1347-1363 dynamic group never restored",
        versions=VERSIONS,
        targets=(
            Target(_TE, "TEDotProductAttention.__init__", make_te_init),
            Target(_TE, "TEDotProductAttention.forward", make_te_forward),
        ),
        requires_te=True,
    ),
    Patch(
        name="pg-collection-repr",
        summary="ProcessGroupCollection.__repr__ works when hcp is a list of groups",
        upstream="megatron/core/process_groups_config.py:143-158 __repr__ calls pg.size() on the "
        "hcp list",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.process_groups_config", "ProcessGroupCollection.__repr__",
                   _make_pgc_repr),
        ),
    ),
)
