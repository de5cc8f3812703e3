"""Core-attention modules that megatron-core layer specs accept, CP groups from one decision.

* :class:`ReferenceCPAttention` - megatron's core-attention contract on top of the pure-PyTorch
  backend (any device, any torch.distributed backend).
* Transformer Engine: megatron's own ``TEDotProductAttention`` with the ``te-attention-hcp``
  patch (:mod:`.te`; the one TE path).
* :func:`core_attention_class` / :func:`gpt_layer_spec` pick TE when present, else the reference.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .groups import CPGroups, mpu_pg_collection, resolve_cp_groups, uses_dynamic_cp
from .partition import partition_mode
from .reference import context_parallel_attention, local_attention
from .reference.api import check_window
from .te import TEUnavailableError, have_te, te_attention_class

__all__ = ["ReferenceCPAttention", "TEUnavailableError", "core_attention_class",
           "gpt_layer_spec", "have_te", "partition_mode"]

_CAUSAL = {AttnMaskType.causal, AttnMaskType.padding_causal}
_FULL = {AttnMaskType.no_mask, AttnMaskType.padding}


class ReferenceCPAttention(MegatronModule):
    """megatron core attention (``[s, b, h, d]`` or packed ``thd``) with CP on any backend.

    Same constructor and forward contract as megatron's ``DotProductAttention`` (with its
    ``window_size`` and ``softmax_type`` config fields); CP groups are
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
        k_channels: int | None = None,
        v_channels: int | None = None,
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
            pg_collection = mpu_pg_collection()
        self.pg_collection = pg_collection
        # megatron's distributed checkpointing reads it (a collection's, never the MPU's)
        self.tp_group = getattr(pg_collection, "tp", None)
        self.attn_mask_type = attn_mask_type
        self.cp_comm_type = cp_comm_type
        self._init_softmax_offset(config)
        if getattr(config, "window_attn_skip_freq", None) is not None:
            raise ValueError(
                f"window_attn_skip_freq={config.window_attn_skip_freq!r}: the reference CP "
                "attention applies window_size to every layer; unset window_attn_skip_freq"
            )
        window = getattr(config, "window_size", None)
        self.window_size = check_window(None if window is None else tuple(window))
        # MLA passes q/k's and v's head dims (k_channels, v_channels); the kernels read v's
        # from the tensors, the default scale uses q/k's
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        # Fail at build time, not mid-step, when CP is configured but its groups are missing.
        self.static_groups = resolve_cp_groups(
            config.context_parallel_size, cp_comm_type, pg_collection
        )

    def _init_softmax_offset(self, config) -> None:
        """megatron's ``softmax_type``: ``vanilla`` (none), ``off-by-one`` (zero offsets) or
        ``learnable`` (a parameter per local head, initialized with ``config.init_method``
        and marked tensor-parallel along the heads, so TP shards it like the heads)."""
        softmax_type = getattr(config, "softmax_type", "vanilla")
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype),
                                 persistent=False)
        elif softmax_type == "learnable":
            from megatron.core.tensor_parallel.layers import (
                set_tensor_model_parallel_attributes,
            )

            self.softmax_offset = torch.nn.Parameter(torch.empty(heads,
                                                                 dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        else:
            raise ValueError(f"softmax_type={softmax_type!r}: use vanilla, off-by-one or "
                             "learnable")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """megatron's distributed checkpointing: the learnable softmax offset, sharded over TP
        along its heads (as megatron's own core attention does); nothing else is stored."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        learnable = isinstance(self.softmax_offset, torch.nn.Parameter)
        state = self.state_dict(prefix="", keep_vars=True) if learnable else {}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"])

    def cp_groups(self, packed_seq_params: Any = None) -> CPGroups:
        if not uses_dynamic_cp(packed_seq_params):
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
                                      qkv_format="thd" if thd else "sbhd",
                                      window_size=self.window_size,
                                      softmax_offset=self.softmax_offset,
                                      # a post-scale bias over the whole sequence (p2p with CP)
                                      attention_bias=attention_bias)
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
                query, key, value, cp_comm_type=groups.comm_type, cp_group=groups.group,
                cp_partition_mode=partition_mode(self.config, packed_seq_params), **kwargs
            )
        else:
            out = local_attention(query, key, value, **kwargs)
        return out.reshape(*out.shape[:-2], -1)


def core_attention_class(backend: str = "auto"):
    """The core-attention class for ``backend`` (``auto``: TE when it imports)."""
    if backend == "te" or (backend == "auto" and have_te()):
        return te_attention_class()
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
