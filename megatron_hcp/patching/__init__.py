"""Named, version-gated runtime patches of megatron-core (see ``megatron-hcp patch list``)."""

from __future__ import annotations

from .cpu_runtime import (
    CPU_RUNTIME_PATCHES,
    TRAINING_CPU_RUNTIME_PATCHES,
    apply_cpu_runtime,
    revert_cpu_runtime,
)
from .hybrid import HYBRID_PATCHES
from .integration import INTEGRATION_PATCHES
from .mla import MLA_CPU_RUNTIME_PATCHES, MLA_DECENTRALIZED_PATCHES
from .mla_dynamic_cp import MLA_DYNAMIC_CP_PATCHES
from .moe_dispatch import MOE_DISPATCH_PATCHES
from .moe_router import MOE_ROUTER_PATCHES
from .registry import Patch, PatchError, apply, is_applied, megatron_core_version, revert

__all__ = [
    "ALL_PATCHES",
    "CPU_RUNTIME_PATCHES",
    "DECENTRALIZED_PATCHES",
    "DYNAMIC_CP_PATCHES",
    "INTEGRATION_PATCHES",
    "LOCAL_SPEC_PATCHES",
    "MLA_CPU_RUNTIME_PATCHES",
    "MLA_DECENTRALIZED_PATCHES",
    "TRAINING_CPU_RUNTIME_PATCHES",
    "Patch",
    "PatchError",
    "apply",
    "apply_cpu_runtime",
    "apply_dynamic_cp",
    "require_applied",
    "by_name",
    "is_applied",
    "megatron_core_version",
    "revert",
    "revert_cpu_runtime",
]

ALL_PATCHES: tuple[Patch, ...] = (INTEGRATION_PATCHES + CPU_RUNTIME_PATCHES
                                  + TRAINING_CPU_RUNTIME_PATCHES + MLA_CPU_RUNTIME_PATCHES
                                  + MLA_DECENTRALIZED_PATCHES + MOE_DISPATCH_PATCHES
                                  + HYBRID_PATCHES + MLA_DYNAMIC_CP_PATCHES
                                  + MOE_ROUTER_PATCHES)


def by_name(names: list[str] | None = None) -> list[Patch]:
    """The named patches (all when ``names`` is None); unknown names raise PatchError."""
    if names is None:
        return list(ALL_PATCHES)
    table = {p.name: p for p in ALL_PATCHES}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise PatchError(f"unknown patch(es) {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]


# what megatron-core needs to run dynamic-CP micro-batches (RoPE per micro-batch group;
# variable packed lengths through pipeline stages; MTP's rolls per micro-batch group, and on
# 0.19.2 its per-token counts over the CP group, static CP included)
DYNAMIC_CP_PATCHES: tuple[str, ...] = ("attention-dynamic-cp-rope", "p2p-variable-seq-lengths",
                                       "mtp-dynamic-cp-group")

# what megatron-core's training path needs without MPU globals (decentralized process groups)
DECENTRALIZED_PATCHES: tuple[str, ...] = ("cross-entropy-model-tp-group",
                                          "chained-optimizer-count-zeros-tp-group",
                                          "moe-metrics-collection-dp",
                                          "yarn-rope-model-cp-group")

# what megatron-core's local (non-TE) layers need for the models megatron-hcp trains on them
# (expert MLPs with biases, e.g. gpt-oss, with TP=1)
LOCAL_SPEC_PATCHES: tuple[str, ...] = ("row-parallel-tp1-output",)


def apply_dynamic_cp() -> None:
    """Apply :data:`DYNAMIC_CP_PATCHES` (idempotent), ``moe-allgather-variable-tokens`` (MoE's
    all-gather dispatcher with expert-parallel ranks of different token counts),
    ``mla-dynamic-cp-group`` (multi-latent attention), ``moe-router-dynamic-cp-group`` (MoE
    routers' losses per micro-batch group), and ``mamba-dynamic-cp-group`` where Mamba's kernels
    are installed."""
    apply(by_name([*DYNAMIC_CP_PATCHES, "moe-allgather-variable-tokens",
                   "mla-dynamic-cp-group", "moe-router-dynamic-cp-group"]))
    mamba = by_name(["mamba-dynamic-cp-group"])
    if not mamba[0].missing_requirement():
        apply(mamba)


def require_applied(names: tuple[str, ...], why: str) -> None:
    """Raise :class:`PatchError` naming the patches of ``names`` that are not applied."""
    from .forkpatch import applied_in_source

    missing = [p.name for p in by_name(list(names))
               if not is_applied(p) and not applied_in_source(p)]
    if missing:
        raise PatchError(
            f"{why} needs the megatron-core patches {missing}; apply them first "
            "(megatron_hcp.patching.apply_dynamic_cp() or `megatron-hcp patch apply`)"
        )
