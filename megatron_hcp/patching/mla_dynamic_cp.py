"""Multi-latent attention (DeepSeek-V3, Moonlight) with dynamic CP.

megatron-core refuses a dynamic-CP micro-batch in MLA: ``MLASelfAttention.
get_query_key_value_tensors`` asserts ``packed_seq_params.local_cp_size is None``
("hybrid_context_parallel is not supported with MLA yet"). What MLA needs for one (the first
is what ``attention-dynamic-cp-rope`` gives ordinary attention, whose forward MLA overrides):

* RoPE of q's and k's positional parts with the micro-batch's CP group: MLA applies it in
  ``get_query_key_value_tensors`` with ``cp_group=self.pg_collection.cp`` (the fused kernels
  with that group's rank and size), which under dynamic CP must be the micro-batch's group
  (``packed_seq_params.cp_group``; local CP size 1: no CP);
* the whole RoPE table: MLA shortens it to the rank's token count when the model's static
  ``context_parallel_size`` is 1 ("during training the sequence length is always the full
  rotary_pos_emb length, except for sequence packing + CP") - with dynamic CP over a static
  CP of 1 a micro-batch's group can still cut its sequences over several ranks, whose positions
  then run past the shortened table;
* the core attention keeps the micro-batch's ``PackedSeqParams`` as it is (its dynamic group,
  which megatron-hcp's CP attention runs on).

``mla-dynamic-cp-group`` wraps ``MultiLatentAttention.forward``: for a dynamic-CP micro-batch the
module's ``pg_collection.cp`` is the micro-batch's group for the call (restored after), the
q/k/v projection sees the micro-batch's ``PackedSeqParams`` without ``local_cp_size`` (the
assertion's field: the group itself travels in ``cp_group``, which that function does not
read) and the model's CP size as the group's (the table stays whole), and the core attention
gets the micro-batch's ``PackedSeqParams`` unchanged. Any other micro-batch runs upstream's code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from ..attention.groups import micro_batch_cp_group
from .partition_layout import NoCPGroup
from .registry import Patch, Target

__all__ = ["MLA_DYNAMIC_CP_PATCHES"]

VERSIONS = ("0.16.1", "0.19.2")
_MLA = "megatron.core.transformer.multi_latent_attention"
_QKV = "get_query_key_value_tensors"


def _make_forward(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        """Upstream's; a dynamic-CP micro-batch with its own CP group (module docstring)."""
        params = signature.bind_partial(self, *args, **kwargs).arguments.get(
            "packed_seq_params")
        dynamic, group = micro_batch_cp_group(params)
        if not dynamic:
            return original(self, *args, **kwargs)
        group = group if group is not None else NoCPGroup()
        qkv = getattr(type(self), _QKV)
        qkv_signature = inspect.signature(qkv)
        static_params = dataclasses.replace(params, local_cp_size=None)

        @functools.wraps(qkv)
        def get_query_key_value_tensors(*qkv_args, **qkv_kwargs):
            bound = qkv_signature.bind(self, *qkv_args, **qkv_kwargs)
            if bound.arguments.get("packed_seq_params") is params:
                bound.arguments["packed_seq_params"] = static_params
            config, cp_size = self.config, self.config.context_parallel_size
            config.context_parallel_size = max(cp_size, group.size())
            try:
                return qkv(*bound.args, **bound.kwargs)
            finally:
                config.context_parallel_size = cp_size

        static_group = self.pg_collection.cp
        self.pg_collection.cp = group
        self.__dict__[_QKV] = get_query_key_value_tensors  # this call's, on this module
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.__dict__[_QKV]
            self.pg_collection.cp = static_group

    return forward


MLA_DYNAMIC_CP_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="mla-dynamic-cp-group",
        summary="multi-latent attention runs dynamic-CP micro-batches: RoPE over the "
        "micro-batch's CP group with the whole table, the core attention with the "
        "micro-batch's PackedSeqParams (its group), the static group restored after",
        upstream="megatron/core/transformer/multi_latent_attention.py:683-688 (0.16.1: 529-534) "
        "get_query_key_value_tensors asserts packed_seq_params.local_cp_size is None; 806,814,"
        "880-881,941,951 RoPE with self.pg_collection.cp; 911 shortens the RoPE table to the "
        "rank's tokens when config.context_parallel_size == 1",
        versions=VERSIONS,
        targets=(
            Target(_MLA, "MultiLatentAttention.forward", _make_forward,
                   params=("self", "hidden_states", "attention_mask")),
        ),
    ),
)
