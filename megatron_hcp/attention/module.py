"""Core-attention modules that megatron-core layer specs accept, CP groups from one decision.

* :class:`ReferenceCPAttention` - megatron's core-attention contract on top of the pure-PyTorch
  backend (any device, any torch.distributed backend).
* :func:`te_cp_attention_class` - a subclass of megatron's ``TEDotProductAttention`` whose CP
  groups come from :func:`~megatron_hcp.attention.groups.resolve_cp_groups` (``pg_collection.hcp``
  for a2a+p2p, the per-micro-batch dynamic group), with a lazily created ``cp_stream`` and the
  constructor's group restored after every forward. Only built when Transformer Engine imports;
  it has not been run on this project's CPU machines.
* :func:`core_attention_class` / :func:`gpt_layer_spec` pick TE when present, else the reference.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .groups import CPGroups, resolve_cp_groups, te_cp_kwargs
from .reference import context_parallel_attention, local_attention

__all__ = [
    "ReferenceCPAttention",
    "TEUnavailableError",
    "core_attention_class",
    "gpt_layer_spec",
    "have_te",
    "make_te_forward",
    "make_te_init",
    "rebind_te_cp_groups",
    "require_te",
    "te_cp_attention_class",
    "te_unavailable_reason",
]

logger = logging.getLogger("megatron_hcp")
_CAUSAL = {AttnMaskType.causal, AttnMaskType.padding_causal}
_FULL = {AttnMaskType.no_mask, AttnMaskType.padding}


def _default_pg_collection():
    """MPU groups (tp, cp, hcp) as a ProcessGroupCollection, without asserting they exist."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        tp=ps.get_tensor_model_parallel_group(check_initialized=False),
        cp=ps.get_context_parallel_group(check_initialized=False),
        hcp=ps.get_hierarchical_context_parallel_groups(check_initialized=False),
    )


class ReferenceCPAttention(MegatronModule):
    """megatron core attention (``[s, b, h, d]`` or packed ``thd``) with CP on any backend.

    Same constructor and forward contract as megatron's ``DotProductAttention``; CP groups are
    resolved per call (static groups from ``pg_collection``; dynamic ones from
    ``packed_seq_params``). Attention dropout is not implemented (set ``attention_dropout=0``);
    an explicit ``attention_mask`` is honoured only as "causal" or "none" through the mask type.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout={dropout}: the reference CP attention does not implement "
                "attention dropout; set attention_dropout=0.0"
            )
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: only self-attention has CP")
        if pg_collection is None:
            pg_collection = _default_pg_collection()
        self.pg_collection = pg_collection
        self.attn_mask_type = attn_mask_type
        self.cp_comm_type = cp_comm_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        # Fail at build time, not mid-step, when CP is configured but its groups are missing.
        self.static_groups = resolve_cp_groups(
            config.context_parallel_size, cp_comm_type, pg_collection
        )

    def cp_groups(self, packed_seq_params: Any = None) -> CPGroups:
        if not _uses_dynamic_cp(packed_seq_params):
            return self.static_groups
        return resolve_cp_groups(
            self.config.context_parallel_size, self.cp_comm_type, self.pg_collection,
            packed_seq_params,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the reference CP attention")
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in _CAUSAL | _FULL:
            raise ValueError(f"attn_mask_type={mask_type}: use causal or no_mask")
        causal = mask_type in _CAUSAL
        if mask_type in _FULL and attention_mask is not None:
            raise ValueError(
                "an explicit attention_mask is not supported by the reference CP attention; "
                "use a causal or no_mask attn_mask_type (packed data: cu_seqlens)"
            )
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        kwargs: dict[str, Any] = dict(causal=causal, softmax_scale=self.softmax_scale,
                                      qkv_format="thd" if thd else "sbhd")
        if thd:
            kwargs.update(
                cu_seqlens_q=packed_seq_params.cu_seqlens_q,
                cu_seqlens_kv=packed_seq_params.cu_seqlens_kv,
                cu_seqlens_q_padded=packed_seq_params.cu_seqlens_q_padded,
                cu_seqlens_kv_padded=packed_seq_params.cu_seqlens_kv_padded,
            )
        groups = self.cp_groups(packed_seq_params)
        if groups.enabled:
            out = context_parallel_attention(
                query, key, value, cp_comm_type=groups.comm_type, cp_group=groups.group, **kwargs
            )
        else:
            out = local_attention(query, key, value, **kwargs)
        return out.reshape(*out.shape[:-2], -1)


class TEUnavailableError(RuntimeError):
    """``backend="te"`` was asked for but Transformer Engine cannot be used (says why)."""


_te_failure_logged: set[str] = set()


def te_unavailable_reason() -> str | None:
    """Why Transformer Engine cannot be used here (None: it can).

    A broken install (the import raises, e.g. a missing CUDA library) is reported with its
    exception; a missing one says so.
    """
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception as err:  # a broken TE install raises anything (OSError, RuntimeError, ...)
        return (f"importing megatron.core.extensions.transformer_engine failed: "
                f"{type(err).__name__}: {err}")
    if not getattr(te_ext, "HAVE_TE", False):
        return "Transformer Engine is not installed (megatron-core reports HAVE_TE=False)"
    return None


def have_te() -> bool:
    """True when Transformer Engine and megatron's TE extension import.

    A broken install is not swallowed silently: the reason is logged (once) before falling
    back to the reference backend."""
    reason = te_unavailable_reason()
    if reason is not None and "not installed" not in reason and reason not in _te_failure_logged:
        _te_failure_logged.add(reason)
        logger.warning("Transformer Engine is unusable, using the reference CP attention "
                       "backend: %s", reason)
    return reason is None


def require_te() -> None:
    """Raise :class:`TEUnavailableError` with the reason when TE cannot be used."""
    reason = te_unavailable_reason()
    if reason is not None:
        raise TEUnavailableError(
            f"backend='te' needs Transformer Engine: {reason}. Fix the installation, or use "
            "backend='reference' (or 'auto', which falls back with a warning)")


def _uses_dynamic_cp(packed_seq_params: Any) -> bool:
    return packed_seq_params is not None and (
        getattr(packed_seq_params, "local_cp_size", None) is not None
        or getattr(packed_seq_params, "cp_group", None) is not None
    )


def _apply_te_groups(module: Any, groups: CPGroups) -> None:
    """Hand ``groups`` to TE; the class-wide cp_stream is created lazily, when CP really runs."""
    stream = None
    if groups.enabled:
        cls = type(module)
        if getattr(cls, "cp_stream", None) is None:
            cls.cp_stream = torch.cuda.Stream()
        stream = cls.cp_stream
    kw = te_cp_kwargs(groups, stream)
    module.set_context_parallel_group(
        kw["cp_group"], kw["cp_global_ranks"], kw["cp_stream"], kw["cp_comm_type"]
    )


def rebind_te_cp_groups(module: Any, pg_collection: Any, context_parallel_size: int,
                        cp_comm_type: str) -> CPGroups:
    """Give a TE attention module the CP groups of ``pg_collection`` (hcp for a2a+p2p).

    For code that rebinds TE modules itself (Megatron-Bridge hands TE the flat CP group):
    the groups are resolved by :func:`resolve_cp_groups`, handed to TE, and remembered for the
    dynamic-CP restore of the ``te-attention-hcp`` patch.
    """
    groups = resolve_cp_groups(context_parallel_size, cp_comm_type, pg_collection)
    _apply_te_groups(module, groups)
    if hasattr(module, "_cp_resolution"):
        module._cp_resolution = (pg_collection, cp_comm_type, groups)
    return groups


def make_te_init(original_init):
    """``TEDotProductAttention.__init__`` whose CP groups come from :func:`resolve_cp_groups`.

    TE is built without CP (no eager CUDA stream, no read of megatron's global hierarchical
    groups), then given the resolved groups: ``pg_collection.hcp`` for a2a+p2p.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, *args, cp_comm_type="p2p",
                 pg_collection=None, **kwargs):
        if pg_collection is None:
            pg_collection = _default_pg_collection()
        static = resolve_cp_groups(config.context_parallel_size, cp_comm_type, pg_collection)
        no_cp = copy.copy(config)
        no_cp.context_parallel_size = 1
        original_init(self, no_cp, layer_number, attn_mask_type, attention_type,
                      attention_dropout, softmax_scale, *args, cp_comm_type=cp_comm_type,
                      pg_collection=pg_collection, **kwargs)
        self.config = config
        self._cp_resolution = (pg_collection, cp_comm_type, static)
        _apply_te_groups(self, static)

    return __init__


def make_te_forward(original_forward):
    """``TEDotProductAttention.forward`` that switches to the micro-batch's dynamic CP group
    (``packed_seq_params``) and restores the constructor's groups afterwards."""

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if not _uses_dynamic_cp(packed_seq_params):
            return original_forward(self, query, key, value, attention_mask, attn_mask_type,
                                    attention_bias=attention_bias,
                                    packed_seq_params=packed_seq_params, **kwargs)
        pg_collection, comm_type, static = self._cp_resolution
        _apply_te_groups(self, resolve_cp_groups(
            self.config.context_parallel_size, comm_type, pg_collection, packed_seq_params))
        # upstream forward would switch groups again and never restore them: hide the fields
        stripped = copy.copy(packed_seq_params)
        stripped.cp_group = None
        stripped.local_cp_size = None
        try:
            return original_forward(self, query, key, value, attention_mask, attn_mask_type,
                                    attention_bias=attention_bias, packed_seq_params=stripped,
                                    **kwargs)
        finally:
            _apply_te_groups(self, static)

    return forward


def te_cp_attention_class():
    """``TEDotProductAttention`` with project-resolved CP groups (requires TE to run)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return type(
        "TECPAttention",
        (TEDotProductAttention,),
        {
            "__doc__": "TE attention whose CP groups come from resolve_cp_groups (hcp, dynamic).",
            "__init__": make_te_init(TEDotProductAttention.__init__),
            "forward": make_te_forward(TEDotProductAttention.forward),
        },
    )


def core_attention_class(backend: str = "auto"):
    """The core-attention class for ``backend`` (``auto``: TE when it imports)."""
    if backend == "te":
        require_te()
        return te_cp_attention_class()
    if backend == "auto" and have_te():
        return te_cp_attention_class()
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend={backend!r}: use auto, te or reference")
    return ReferenceCPAttention


def gpt_layer_spec(backend: str = "auto", **local_spec_kwargs: Any):
    """A GPT layer spec whose core attention is :func:`core_attention_class` (``backend``).

    Reference backend: megatron's local spec (``get_gpt_layer_local_spec``). TE backend:
    megatron's TE spec (``get_gpt_layer_with_transformer_engine_spec``).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    cls = core_attention_class(backend)
    if cls is ReferenceCPAttention:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**local_spec_kwargs)
    else:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**local_spec_kwargs)
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = cls
    return spec
