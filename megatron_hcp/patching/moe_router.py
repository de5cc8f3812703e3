"""MoE routers' load-balancing and z-losses with dynamic CP.

megatron-core's router computes its losses over its ``tp_cp_group``: the tokens each expert
received are all-reduced over it (``_apply_aux_loss`` / ``_apply_seq_aux_loss``), the token
total is the local count times its size, the z-loss coefficient and the per-token loss scaling
divide / multiply by its size, and quantile balancing (0.19.2) gathers logits over it. That group
is the *static* TP x CP group. A dynamic-CP micro-batch runs on its own group (1, 2, ... ranks of
the DPxCP group), the other ranks of the static group run other micro-batches: the counts were
summed over several micro-batches' tokens and the sizes were the static ones (measured: the same
dynamic-CP plan trained differently with a static CP of 4 and of 1, 2.6e-5 in grad norm with
Qwen3-MoE's aux loss).

``moe-router-dynamic-cp-group`` wraps ``TransformerLayer.forward``: for a dynamic-CP micro-batch
through a layer with a MoE router, the router's ``tp_cp_group`` is the micro-batch's CP group for
the call (one rank: no group; TP 1), the static group restored after - also in the MoE metrics
tracker, whose entries keep the group they were last recorded with and reduce over it when the
step's metrics are logged (the micro-batch's group there would pair ranks whose last
micro-batches differ). What the patch cannot give the micro-batch's group is refused by
:func:`dynamic_cp_router_problems` (Bridge's loop checks it before any process group; the
patched forward checks it again on its first such micro-batch, on every rank alike):

* TP > 1: the router's group is then TP x the micro-batch's CP group, a group no one creates;
* ``global_aux_loss``: its token total is the local count times the TP x DP x CP size, which
  assumes every rank holds as many tokens - dynamic CP's micro-batches do not;
* selective recompute of ``moe``: the router runs again in backward, after the static group was
  restored.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..attention.groups import micro_batch_cp_group
from ..config import CPConfigError, Violation
from .partition_layout import NoCPGroup
from .registry import Patch, Target

__all__ = ["MOE_ROUTER_PATCHES", "dynamic_cp_router_problems", "router_group_uses"]

VERSIONS = ("0.16.1", "0.19.2")
_LAYER = "megatron.core.transformer.transformer_layer"
_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _aux_coefficients(config: Any) -> dict[str, float]:
    """Load-balancing loss type -> its coefficient, as megatron's ``Router.get_aux_loss_coeff``
    reads ``moe_router_load_balancing_type`` and ``moe_aux_loss_coeff`` (a name or a list)."""
    types = getattr(config, "moe_router_load_balancing_type", None)
    coeffs = getattr(config, "moe_aux_loss_coeff", None)
    if isinstance(types, str):
        return {types: float(coeffs or 0.0)} if types in _LOSSES else {}
    if isinstance(types, (list, tuple)):
        values = coeffs if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
        return {t: float(c or 0.0) for t, c in zip(types, values) if t in _LOSSES}
    return {}


def router_group_uses(config: Any) -> list[str]:
    """What a MoE router of ``config`` (a megatron ``TransformerConfig`` or Bridge's provider)
    computes over its TP x CP group: its load-balancing losses with a coefficient, the z-loss,
    quantile balancing. Empty without MoE."""
    if not getattr(config, "num_moe_experts", None):
        return []
    uses = [name for name, coeff in _aux_coefficients(config).items() if coeff > 0]
    if getattr(config, "moe_z_loss_coeff", None):
        uses.append("z_loss")
    types = getattr(config, "moe_router_load_balancing_type", None)
    if "quantile_balancing" in ([types] if isinstance(types, str) else list(types or ())):
        uses.append("quantile_balancing")
    return uses


def dynamic_cp_router_problems(config: Any, prefix: str = "model.") -> list[Violation]:
    """Why a MoE router of ``config`` cannot run dynamic-CP micro-batches on their own group
    (module docstring); empty when it can, or when its router uses no group."""
    uses = router_group_uses(config)
    if not uses:
        return []
    problems = []
    what = ", ".join(uses)
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if tp > 1:
        problems.append(Violation(
            f"{prefix}tensor_model_parallel_size", tp,
            f"the MoE router's {what} reduces over TP x the micro-batch's CP group under "
            "dynamic CP, and no such group exists (the static TP x CP group would mix other "
            "micro-batches' tokens in)",
            f"use {prefix}tensor_model_parallel_size=1 with dynamic CP and MoE losses (expert "
            "parallelism instead), or set their coefficients to 0"))
    if "global_aux_loss" in uses:
        problems.append(Violation(
            f"{prefix}moe_router_load_balancing_type",
            getattr(config, "moe_router_load_balancing_type", None),
            "global_aux_loss counts its tokens as the local count times the TP x DP x CP size, "
            "which assumes every rank holds as many tokens; dynamic CP's micro-batches do not",
            "use aux_loss or seq_aux_loss with dynamic CP"))
    recompute = list(getattr(config, "recompute_modules", None) or [])
    if ((getattr(config, "recompute_granularity", None) == "selective" and "moe" in recompute)
            or getattr(config, "moe_layer_recompute", False)):
        problems.append(Violation(
            f"{prefix}recompute_modules", recompute,
            f"selective recompute of moe runs the router again in backward, after the "
            f"micro-batch's CP group was given back: its {what} would be recomputed over the "
            "static group (wrong gradients, no error)",
            f"drop moe from {prefix}recompute_modules under dynamic CP (moe_act or "
            f"{prefix}recompute_granularity=full recompute correctly)"))
    return problems


def _tracked_back(swapped: Any, static: Any) -> None:
    """Entries of megatron's MoE metrics tracker last recorded with ``swapped`` reduce over
    ``static`` again (0.19.2: the tracker object's metrics; 0.16.1: the layer-wise dict)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16.1
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        for entry in get_moe_layer_wise_logging_tracker().values():
            if entry.get("reduce_group") is swapped:
                entry["reduce_group"] = static
        return
    for entry in get_moe_metrics_tracker()._metrics.values():
        if entry.reduce_group is swapped:
            entry.reduce_group = static


def _packed_seq_params(layer: Any, args: tuple, kwargs: dict) -> Any:
    """The ``packed_seq_params`` of a ``TransformerLayer.forward`` call (upstream's forward takes
    ``*args, **kwargs`` and hands them to ``_forward_attention``, whose signature names it)."""
    if "packed_seq_params" in kwargs or not args:
        return kwargs.get("packed_seq_params")
    signature = inspect.signature(type(layer)._forward_attention)
    return signature.bind_partial(layer, *args, **kwargs).arguments.get("packed_seq_params")


def _make_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        """Upstream's; a dynamic-CP micro-batch's router on the micro-batch's group (module
        docstring)."""
        router = getattr(getattr(self, "mlp", None), "router", None)
        if router is None or not router_group_uses(self.config):
            return original(self, *args, **kwargs)
        dynamic, group = micro_batch_cp_group(_packed_seq_params(self, args, kwargs))
        if not dynamic:
            return original(self, *args, **kwargs)
        problems = dynamic_cp_router_problems(self.config, prefix="config.")
        if problems:
            raise CPConfigError(problems)
        static = router.tp_cp_group
        swapped = group if group is not None else NoCPGroup()
        router.tp_cp_group = swapped
        try:
            return original(self, *args, **kwargs)
        finally:
            router.tp_cp_group = static
            _tracked_back(swapped, static)

    return forward


MOE_ROUTER_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="moe-router-dynamic-cp-group",
        summary="a MoE router's load-balancing and z-losses of a dynamic-CP micro-batch over "
        "the micro-batch's CP group (token counts, token total, sizes), the static group "
        "restored after, also in the MoE metrics tracker",
        upstream="megatron/core/transformer/moe/router.py:419-443,470-498,654,633-673 (0.16.1: "
        "287-311,338-366,486) reduce and scale over self.tp_cp_group, the static TP x CP group, "
        "for every micro-batch; the layer that knows the micro-batch's group is "
        "megatron/core/transformer/transformer_layer.py:747 (0.16.1: 502) TransformerLayer.forward",
        versions=VERSIONS,
        targets=(
            Target(_LAYER, "TransformerLayer.forward", _make_forward),
        ),
    ),
)
