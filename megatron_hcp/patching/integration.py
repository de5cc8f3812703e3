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
        """Upstream destroy, then destroy the groups it created and reset every global it
        leaves set (groups and rank lists)."""
        from megatron.core import parallel_state as ps

        from ..parallel_state.mpu import destroy_groups, forget_stale_groups

        created = list(getattr(ps, "_global_process_group_list", None) or [])
        original(*args, **kwargs)
        destroy_groups(created)
        forget_stale_groups(ps)

    return destroy_model_parallel


def _make_lm_loss(original):
    def compute_language_model_loss(self, labels, logits):
        """Unfused cross-entropy over the model's own TP group (``pg_collection.tp``)."""
        from .cross_entropy import vocab_parallel_cross_entropy

        if self.config.cross_entropy_loss_fusion:
            return original(self, labels, logits)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                            self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()

    return compute_language_model_loss


class NoCPGroup:
    """What RoPE needs of a CP group when a dynamic-CP micro-batch runs without CP.

    Only ``size()`` and ``rank()``: RoPE slicing reads those and nothing else in
    ``Attention.forward`` uses the CP group of ``pg_collection``.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _make_attention_forward(original):
    def forward(self, *args, **kwargs):
        """Apply RoPE with the micro-batch's dynamic CP group, then restore the static one."""
        params = kwargs.get("packed_seq_params")
        if params is None and len(args) > 9:
            params = args[9]
        group = getattr(params, "cp_group", None)
        local = getattr(params, "local_cp_size", None)
        if group is None and local != 1:
            return original(self, *args, **kwargs)
        static = self.pg_collection.cp
        self.pg_collection.cp = group if group is not None else NoCPGroup()
        try:
            return original(self, *args, **kwargs)
        finally:
            self.pg_collection.cp = static

    return forward


def _make_communicate_shapes(original):
    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        """Exchange the [s, b, h] shapes of the tensors about to travel, in the even/odd order
        of megatron's ``_p2p_ops``: with two stages the previous and next rank are the same
        peer, and posting send_prev before send_next on every rank pairs the activation's
        shape with the gradient's receive."""
        import torch
        import torch.distributed as dist

        sent = tensor_send_next if tensor_send_next is not None else tensor_send_prev
        device = sent.device if sent is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        recv_prev_t = torch.empty(3, dtype=torch.int64, device=device) if recv_prev else None
        recv_next_t = torch.empty(3, dtype=torch.int64, device=device) if recv_next else None

        def shape(t):
            return torch.tensor(t.size(), dtype=torch.int64, device=device)

        send_next = (lambda: dist.isend(shape(tensor_send_next), self.next_rank,
                                        group=self.pp_group)) if tensor_send_next is not None \
            else None
        send_prev = (lambda: dist.isend(shape(tensor_send_prev), self.prev_rank,
                                        group=self.pp_group)) if tensor_send_prev is not None \
            else None
        get_prev = (lambda: dist.irecv(recv_prev_t, self.prev_rank, group=self.pp_group)
                    ) if recv_prev else None
        get_next = (lambda: dist.irecv(recv_next_t, self.next_rank, group=self.pp_group)
                    ) if recv_next else None
        order = ((send_next, get_prev, send_prev, get_next) if self.pp_group.rank() % 2 == 0
                 else (get_prev, send_next, get_next, send_prev))
        for work in [post() for post in order if post is not None]:
            work.wait()
        return ([0, 0, 0] if recv_prev_t is None else recv_prev_t.tolist(),
                [0, 0, 0] if recv_next_t is None else recv_next_t.tolist())

    return _communicate_shapes


def _make_count_zeros(original):
    def count_zeros(self):
        """Zeros in the gradients of every chained optimizer, with their model's TP group."""
        from megatron.core.optimizer.clip_grads import count_zeros_fp32

        if not self.grads_states_parallel_group_is_shared():
            return original(self)
        tp_groups = {id(getattr(o, "tp_group", None)): getattr(o, "tp_group", None)
                     for o in self.chained_optimizers}
        if len(tp_groups) != 1:
            return original(self)
        params = [p for o in self.chained_optimizers for p in o.get_parameters()]
        return count_zeros_fp32(
            params,
            grad_stats_parallel_group=self.get_grad_stats_parallel_group(),
            use_decoupled_grad=self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            tp_group=next(iter(tp_groups.values())),
        )

    return count_zeros


INTEGRATION_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="attention-dynamic-cp-rope",
        summary="Attention applies RoPE with the micro-batch's dynamic CP group "
        "(packed_seq_params.cp_group / local_cp_size 1) and restores pg_collection.cp after",
        upstream="megatron/core/transformer/attention.py:1103,1107,1116 apply_rotary_pos_emb("
        "..., cp_group=self.pg_collection.cp) ignores packed_seq_params.cp_group",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.transformer.attention", "Attention.forward",
                   _make_attention_forward),
        ),
    ),
    Patch(
        name="cross-entropy-model-tp-group",
        summary="the unfused LM loss uses the model's pg_collection.tp, not the MPU TP group "
        "(decentralized path without MPU globals)",
        upstream="megatron/core/models/common/language_module/language_module.py:167 "
        "tensor_parallel.vocab_parallel_cross_entropy (reads the global TP group, "
        "tensor_parallel/cross_entropy.py:131,137,151,157)",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.models.common.language_module.language_module",
                   "LanguageModule.compute_language_model_loss", _make_lm_loss),
        ),
    ),
    Patch(
        name="destroy-forgets-stale-groups",
        summary="destroy_model_parallel destroys the process groups it created and resets the "
        "hierarchical/hybrid CP groups, intra-partial DP groups and *_GLOBAL_RANKS it leaves set",
        upstream="megatron/core/parallel_state.py:2085-2234 destroy_model_parallel never resets "
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS (115), _HYBRID_DP_CP_GROUPS (117), "
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO) and 7 rank lists; the groups listed "
        "in _global_process_group_list (243-247) are never destroyed",
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
        name="p2p-shape-exchange-order",
        summary="pipeline shape exchange (variable_seq_lengths) posts its sends/receives in "
        "the even/odd order of the data exchange, so PP=2 with VPP pairs each shape with the "
        "right tensor",
        upstream="megatron/core/pipeline_parallel/p2p_communication.py:165-252 "
        "_communicate_shapes posts send_prev, recv_prev, send_next, recv_next on every rank; "
        "with 2 stages prev == next and an activation shape is received as a gradient shape "
        "(measured on gloo: dynamic CP with VPP fails with mismatched packed lengths)",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.pipeline_parallel.p2p_communication",
                   "P2PCommunicator._communicate_shapes", _make_communicate_shapes),
        ),
    ),
    Patch(
        name="chained-optimizer-count-zeros-tp-group",
        summary="ChainedOptimizer.count_zeros passes the optimizers' TP group (log_num_zeros_in_"
        "grad works on the decentralized path without MPU globals)",
        upstream="megatron/core/optimizer/optimizer.py:1289-1298 ChainedOptimizer.count_zeros "
        "calls count_zeros_fp32 without tp_group, which then reads the global TP group "
        "(clip_grads.py:222); MegatronOptimizer.count_zeros (226-231) passes it",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.optimizer.optimizer", "ChainedOptimizer.count_zeros",
                   _make_count_zeros),
        ),
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
