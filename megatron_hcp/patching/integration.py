"""Patches that make megatron-core's own classes honour hierarchical and dynamic CP groups."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ..attention.groups import micro_batch_cp_group
from ..attention.te import make_te_forward, make_te_init
from ..parallel_state.groups import collective_device, destroy_groups
from ..parallel_state.mpu import forget_stale_groups
from .cross_entropy import vocab_parallel_cross_entropy
from .partition_layout import NoCPGroup, make_apply_rope, make_gpt_init, make_rope_table
from .registry import Patch, PatchError, Target

__all__ = ["INTEGRATION_PATCHES", "NoCPGroup", "mamba_cp_for_group", "with_cp_token_counts"]

VERSIONS = ("0.16.1", "0.19.2")
_V16, _V19 = ("0.16.1",), ("0.19.2",)
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

        created = list(getattr(ps, "_global_process_group_list", None) or [])
        original(*args, **kwargs)
        destroy_groups(created)
        forget_stale_groups(ps)

    return destroy_model_parallel


def _make_lm_loss(original):
    def compute_language_model_loss(self, labels, logits):
        """Unfused cross-entropy over the model's own TP group (``pg_collection.tp``)."""
        if self.config.cross_entropy_loss_fusion:
            return original(self, labels, logits)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                            self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()

    return compute_language_model_loss


def _dynamic_group(params: Any) -> tuple[bool, Any]:
    """(dynamic?, group) of a micro-batch's ``packed_seq_params`` (group None: no CP)."""
    return micro_batch_cp_group(params)


def _make_attention_forward(original):
    def forward(self, *args, **kwargs):
        """Apply RoPE with the micro-batch's dynamic CP group, then restore the static one."""
        params = kwargs.get("packed_seq_params")
        if params is None and len(args) > 9:
            params = args[9]
        dynamic, group = _dynamic_group(params)
        if not dynamic:
            return original(self, *args, **kwargs)
        static = self.pg_collection.cp
        self.pg_collection.cp = group if group is not None else NoCPGroup()
        try:
            return original(self, *args, **kwargs)
        finally:
            self.pg_collection.cp = static

    return forward


def _with_dp_cp_gtp_remat(pg_collection: Any) -> Any:
    """``pg_collection`` with ``dp_cp_gtp_remat`` = its ``dp_cp`` where it has none (a copy;
    the caller's collection is unchanged). A collection without the group has no
    weight-rematerialization axis (one rank), so the two groups are one."""
    if getattr(pg_collection, "dp_cp_gtp_remat", None) is not None or getattr(
            pg_collection, "dp_cp", None) is None:
        return pg_collection
    import copy

    completed = copy.copy(pg_collection)
    completed.dp_cp_gtp_remat = pg_collection.dp_cp
    return completed


def _make_moe_metrics_sync(original):
    def _sync_metrics(self, metric_names, pg_collection=None):
        """Upstream's, averaging over the collection's own data-parallel group: a collection
        without ``dp_cp_gtp_remat`` (Megatron-Bridge 0.6.2's decentralized one) gets its
        ``dp_cp`` there, instead of megatron's global data-parallel group, which the
        decentralized path never creates."""
        if pg_collection is not None:
            pg_collection = _with_dp_cp_gtp_remat(pg_collection)
        return original(self, metric_names, pg_collection)

    return _sync_metrics


# tags of the variable-length pipeline exchange: one ordered stream per kind and direction
_TAG_SHAPE_FWD, _TAG_SHAPE_BWD, _TAG_DATA_FWD, _TAG_DATA_BWD = 11, 12, 13, 14


def _make_communicate(original):
    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        """Variable sequence lengths: send shapes and tensors first, then receive.

        Upstream exchanges every shape (blocking) before any tensor moves, all on one channel.
        When the two stages of a PP=2 pipeline group their calls differently (the interleaved
        schedule when every micro-batch is in warm-up on stage 0), stage 1 waits for a shape
        that stage 0 sends only after receiving stage 1's tensor: a deadlock, or a shape matched
        with a tensor. Here sends never wait for receives, and each kind and direction has its
        own tag. Fixed-length exchanges are unchanged.
        """
        if not (self.config.variable_seq_lengths or self.config.mtp_standalone):
            return original(self, tensor_send_next=tensor_send_next,
                            tensor_send_prev=tensor_send_prev, recv_prev=recv_prev,
                            recv_next=recv_next, tensor_shape=tensor_shape,
                            wait_on_reqs=wait_on_reqs)
        import torch
        import torch.distributed as dist

        group, config = self.pp_group, self.config
        sent = tensor_send_next if tensor_send_next is not None else tensor_send_prev
        # the pipeline group's device (a GPU for NCCL, the CPU for gloo), never the machine's
        device = sent.device if sent is not None else collective_device(group)
        works = []
        for tensor, peer, shape_tag, data_tag in (
                (tensor_send_next, self.next_rank, _TAG_SHAPE_FWD, _TAG_DATA_FWD),
                (tensor_send_prev, self.prev_rank, _TAG_SHAPE_BWD, _TAG_DATA_BWD)):
            if tensor is not None:
                size = torch.tensor(tensor.size(), dtype=torch.int64, device=device)
                works.append(dist.isend(size, peer, group=group, tag=shape_tag))
                works.append(dist.isend(tensor, peer, group=group, tag=data_tag))
        received = []
        for wanted, peer, shape_tag, data_tag in (
                (recv_prev, self.prev_rank, _TAG_SHAPE_FWD, _TAG_DATA_FWD),
                (recv_next, self.next_rank, _TAG_SHAPE_BWD, _TAG_DATA_BWD)):
            if not wanted:
                received.append(None)
                continue
            size = torch.empty(3, dtype=torch.int64, device=device)
            dist.irecv(size, peer, group=group, tag=shape_tag).wait()
            buf = torch.empty(size.tolist(), requires_grad=True, device=device,
                              dtype=config.pipeline_dtype)
            works.append(dist.irecv(buf, peer, group=group, tag=data_tag))
            received.append(buf)
        for work in works:
            work.wait()
        return received[0], received[1], ([] if not wait_on_reqs else None)

    return _communicate


def _make_mtp_forward(original):
    def forward(self, *args, **kwargs):
        """Roll tokens, labels and positions over the micro-batch's dynamic CP group."""
        dynamic, group = _dynamic_group(kwargs.get("packed_seq_params"))
        if not dynamic:
            return original(self, *args, **kwargs)
        static = self.cp_group
        self.cp_group = group  # None: megatron's roll_tensor rolls locally (no CP)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.cp_group = static

    return forward


# process_mtp_loss (0.19.2, multi_token_prediction.py:883-886): the per-token branch's
# normalization, and the same with the counts of the whole CP group (the fork diff's text too)
PER_TOKEN_COUNTS = (
    "            num_tokens_safe = torch.clamp(num_tokens, min=1)\n"
    "            mtp_loss_normalized = (\n"
    "                mtp_loss_scale * mtp_loss * (original_num_tokens / num_tokens_safe)\n"
    "            )\n")
CP_TOKEN_COUNTS = (
    "            # megatron-hcp mtp-dynamic-cp-group: the token counts of the whole CP group\n"
    "            # (the micro-batch's sequence, as with CP=1), not this rank's share\n"
    "            cp_original_num_tokens, cp_num_tokens = original_num_tokens, num_tokens\n"
    "            if cp_group is not None and cp_group.size() > 1:\n"
    "                cp_counts = torch.stack([original_num_tokens, num_tokens])\n"
    "                torch.distributed.all_reduce(cp_counts, group=cp_group)\n"
    "                cp_original_num_tokens, cp_num_tokens = cp_counts[0], cp_counts[1]\n"
    "            num_tokens_safe = torch.clamp(cp_num_tokens, min=1)\n"
    "            mtp_loss_normalized = (\n"
    "                mtp_loss_scale * mtp_loss * (cp_original_num_tokens / num_tokens_safe)\n"
    "            )\n")


def with_cp_token_counts(process_mtp_loss: Callable) -> Callable:
    """megatron-core 0.19.2's ``process_mtp_loss`` whose per-token normalization
    (``calculate_per_token_loss``: each MTP token loss times ``tokens / tokens after the roll``)
    counts the tokens of the whole CP group - the micro-batch's sequence - instead of this
    rank's share, as with CP=1: upstream's function compiled from its own source with those
    counts all-reduced over its ``cp_group`` (one all-reduce of two numbers per MTP layer; none
    without CP). Upstream weighs each CP rank by its own counts, and only one rank (CP rank 0,
    holding the sequence's ends) loses a token to the roll, so the MTP gradient depended on
    the CP layout. The logged MTP loss and the non-per-token branch are upstream's. A function
    that already carries the change (megatron-core patched with the fork diff) is returned as
    it is; raises :class:`PatchError` when upstream's source is not the one this edit was
    written for."""
    try:
        source = inspect.getsource(process_mtp_loss)
    except (OSError, TypeError) as err:
        raise PatchError(f"process_mtp_loss={process_mtp_loss!r}: its source cannot be read "
                         f"({err}); the CP token counts need megatron-core 0.19.2's") from None
    if CP_TOKEN_COUNTS in source:
        return process_mtp_loss
    if source.count(PER_TOKEN_COUNTS) != 1 or not source.startswith("def process_mtp_loss("):
        raise PatchError(
            "process_mtp_loss: the per-token normalization "
            f"{PER_TOKEN_COUNTS.splitlines()[0].strip()!r}... must occur once in "
            "megatron-core 0.19.2's function; this release differs (install megatron-core "
            "0.19.2)")
    code = process_mtp_loss.__code__
    edited = "\n" * (code.co_firstlineno - 1) + source.replace(PER_TOKEN_COUNTS,
                                                               CP_TOKEN_COUNTS)
    namespace: dict[str, Any] = {}
    exec(compile(edited, code.co_filename, "exec"),  # noqa: S102 - upstream's own source
         process_mtp_loss.__globals__, namespace)
    return functools.wraps(process_mtp_loss)(namespace["process_mtp_loss"])


def _make_process_mtp_loss(original):
    signature = inspect.signature(original)
    counted = with_cp_token_counts(original)

    def process_mtp_loss(*args, **kwargs):
        """MTP loss with its label rolls over the micro-batch's dynamic CP group, and its
        per-token weights from the token counts of that whole group
        (:func:`with_cp_token_counts`)."""
        bound = signature.bind(*args, **kwargs)
        dynamic, group = _dynamic_group(bound.arguments.get("packed_seq_params"))
        if dynamic:
            bound.arguments["cp_group"] = group  # None: megatron's roll_tensor rolls locally
        return counted(*bound.args, **bound.kwargs)

    return process_mtp_loss


def mamba_cp_for_group(static: Any, group: Any) -> Any:
    """A ``MambaContextParallel`` like ``static`` over ``group`` (None: no CP).

    The constructor's other arguments are read from ``static``'s attributes of the same names,
    so one function serves every megatron-core release (0.16.1 takes ``conv1d_cp1``; 0.19.2
    ``conv1d_weight_cp1``, ``conv1d_bias_cp1`` and ``conv1d_padding``).
    """
    import inspect

    cls = type(static)
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "cp_group")]
    return cls(cp_group=group if group is not None else NoCPGroup(),
               **{name: getattr(static, name) for name in names})


def _make_mamba_forward(original):
    def forward(self, hidden_states, *args, **kwargs):
        """Run the mixer's CP all-to-alls over the micro-batch's dynamic CP group."""
        dynamic, group = _dynamic_group(kwargs.get("packed_seq_params"))
        if not dynamic:
            return original(self, hidden_states, *args, **kwargs)
        cache = self.__dict__.setdefault("_hcp_dynamic_cp", {})
        key = id(group)
        if key not in cache:  # per-group state: head split and rank of this rank
            cache[key] = mamba_cp_for_group(self.cp, group)
        static = self.cp
        self.cp = cache[key]
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            self.cp = static

    return forward


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


def _make_preprocess(original):
    @functools.wraps(original)
    def _preprocess(self, *args, **kwargs):
        """Upstream's, with the model's RoPE table cut for the model's own CP group: GPTModel
        builds YaRN's RoPE without ``cp_group``, which then falls back to megatron's global CP
        group (none on the decentralized path: the table is not cut and a CP rank's tokens meet
        the whole sequence's positions)."""
        rope = getattr(self, "rotary_pos_emb", None)
        group = getattr(getattr(self, "pg_collection", None), "cp", None)
        if (self.position_embedding_type == "yarn" and rope is not None and group is not None
                and rope.cp_group is not group):
            rope.cp_group = group
            rope.forward.cache_clear()  # tables cut for the fallback group are stale
        return original(self, *args, **kwargs)

    return _preprocess


def _make_tp1_reduce(original):
    @functools.wraps(original)
    def reduce_from_tensor_model_parallel_region(input_, group=None):
        """Upstream's all-reduce; over a group of one rank the input itself (upstream's identity
        autograd Function returns it as is, which autograd marks a view that must not be
        modified in place: the expert MLP adds its bias to its output in place)."""
        if group is not None and group.size() == 1:
            return input_
        return original(input_, group)

    return reduce_from_tensor_model_parallel_region


_ROPE = "megatron.core.models.common.embeddings"
INTEGRATION_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="rope-cp-partition-mode",
        summary="RoPE rotates a CP rank's tokens by the positions of its contiguous slice when "
        "the model config says cp_partition_mode='contiguous' (bshd table and packed thd); "
        "zigzag untouched",
        upstream="megatron/core/models/common/embeddings/rotary_pos_embedding.py "
        "RotaryEmbedding.forward and rope_utils.py _apply_rotary_pos_emb_thd cut the table "
        "for chunks r and 2cp-1-r only (get_pos_emb_on_this_cp_rank, "
        "_get_thd_freqs_on_this_cp_rank); megatron's development branch has the layout "
        "(PR #6764), no release up to 0.19.2",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.models.gpt.gpt_model", "GPTModel.__init__", make_gpt_init),
            Target(f"{_ROPE}.rotary_pos_embedding", "RotaryEmbedding.forward",
                   make_rope_table, params=("self", "max_seq_len", "offset", "packed_seq",
                                            "cp_group")),
            Target(f"{_ROPE}.rope_utils", "apply_rotary_pos_emb", make_apply_rope,
                   params=("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group"),
                   also_bound_under="megatron.core"),
        ),
    ),
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
        versions=_V16,
        fixed_in="0.19.0",
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
        name="p2p-variable-seq-lengths",
        summary="pipeline exchange with variable sequence lengths sends shapes and tensors "
        "before it receives, one tag per kind and direction (PP=2 x VPP neither deadlocks nor "
        "mismatches shapes)",
        upstream="megatron/core/pipeline_parallel/p2p_communication.py:165-252,301-304 "
        "_communicate_shapes exchanges every shape (blocking, tag 0, fixed order) before any "
        "tensor is sent; with 2 stages prev == next: measured on gloo, dynamic CP with VPP "
        "mismatches packed lengths, and deadlocks when every micro-batch is in warm-up",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.pipeline_parallel.p2p_communication",
                   "P2PCommunicator._communicate", _make_communicate),
        ),
    ),
    Patch(
        name="mtp-dynamic-cp-group",
        summary="multi-token prediction rolls its inputs and labels over the micro-batch's "
        "dynamic CP group (local CP size 1: locally) and restores its static group after; "
        "0.19.2: its per-token MTP loss weights count the tokens of the whole CP group, as "
        "with CP=1",
        upstream="megatron/core/transformer/multi_token_prediction.py:622,709,716 "
        "MultiTokenPredictionLayer and megatron/core/models/gpt/gpt_model.py:626-638 "
        "(_postprocess, MTP labels) roll with the static cp_group and never look at "
        "packed_seq_params.cp_group; 0.19.2: multi_token_prediction.py:1093-1108 and "
        "process_mtp_loss (760-852), called with cp_group=self.pg_collection.cp by GPTModel "
        "(gpt_model.py:711) and HybridModel (hybrid_model.py:583), whose per-token branch "
        "(876-886) scales each CP rank's MTP token losses by that rank's own original / rolled "
        "token counts (only CP rank 0 loses a token to the roll): the MTP gradient under CP "
        "differed from CP=1's",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.transformer.multi_token_prediction",
                   "MultiTokenPredictionLayer.forward", _make_mtp_forward),
            Target("megatron.core.models.gpt.gpt_model", "GPTModel._postprocess",
                   _make_mtp_forward, versions=_V16),
            *(Target(module, "process_mtp_loss", _make_process_mtp_loss, versions=_V19)
              for module in ("megatron.core.transformer.multi_token_prediction",
                             "megatron.core.models.gpt.gpt_model",
                             "megatron.core.models.hybrid.hybrid_model")),
        ),
    ),
    Patch(
        name="mamba-dynamic-cp-group",
        summary="Mamba mixers run their CP all-to-alls over the micro-batch's dynamic CP group "
        "(one MambaContextParallel per group, cached) and restore the static one after",
        upstream="megatron/core/ssm/mamba_mixer.py:386-397 MambaMixer builds one "
        "MambaContextParallel over pg_collection.cp; mamba_context_parallel.py:88-96 caches "
        "its size and rank",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.ssm.mamba_mixer", "MambaMixer.forward", _make_mamba_forward),
        ),
        requires_modules=("triton", "mamba_ssm"),
    ),
    Patch(
        name="chained-optimizer-count-zeros-tp-group",
        summary="ChainedOptimizer.count_zeros passes the optimizers' TP group (log_num_zeros_in_"
        "grad works on the decentralized path without MPU globals)",
        upstream="megatron/core/optimizer/optimizer.py:1289-1298 ChainedOptimizer.count_zeros "
        "calls count_zeros_fp32 without tp_group, which then reads the global TP group "
        "(clip_grads.py:222); MegatronOptimizer.count_zeros (226-231) passes it",
        versions=_V16,
        fixed_in="0.19.0",
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
        versions=_V16,
        fixed_in="0.18.0",
        targets=(
            Target("megatron.core.process_groups_config", "ProcessGroupCollection.__repr__",
                   _make_pgc_repr),
        ),
    ),
    Patch(
        name="moe-metrics-collection-dp",
        summary="MoE metrics (aux losses) average over the process-group collection's own "
        "data-parallel group when it has no dp_cp_gtp_remat (Bridge's decentralized path)",
        upstream="megatron/core/transformer/moe/moe_logging.py:249-268 (0.19.2) "
        "MoEMetricsTracker._sync_metrics reads pg_collection.dp_cp_gtp_remat and, when the "
        "collection has none, megatron's global data-parallel group: Bridge 0.6.2's "
        "_create_pg_collection (training/initialize.py:534) sets no gtp_remat groups, so a "
        "decentralized MoE run fails at its first MoE log ('data parallel group (with "
        "GTP_remat) is not initialized'); 0.16.1 reduces over pg_collection.dp",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.transformer.moe.moe_logging", "MoEMetricsTracker._sync_metrics",
                   _make_moe_metrics_sync, versions=_V19,
                   params=("self", "metric_names", "pg_collection")),
        ),
    ),
    Patch(
        name="yarn-rope-model-cp-group",
        summary="a GPT model's YaRN RoPE table is cut for the model's own CP group "
        "(pg_collection.cp), not megatron's global one (YaRN under CP on the decentralized path)",
        upstream="megatron/core/models/gpt/gpt_model.py:190-208 (0.16.1: 172-191) GPTModel "
        "builds YarnRotaryEmbedding without cp_group=self.pg_collection.cp (plain RoPE gets it, "
        "177-188), so its table falls back to parallel_state.get_context_parallel_group "
        "(rotary_pos_embedding.py:86-90), None without megatron's global groups: _preprocess "
        "(412-422) then hands every CP rank the whole sequence's table (RuntimeError in "
        "apply_rotary_pos_emb: 'The size of tensor a (16) must match the size of tensor b (64)')",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.models.gpt.gpt_model", "GPTModel._preprocess",
                   _make_preprocess, params=("self", "input_ids", "position_ids")),
        ),
    ),
    Patch(
        name="row-parallel-tp1-output",
        summary="a row-parallel linear over one TP rank returns its output itself, not through "
        "the identity all-reduce Function (expert MLPs with biases train on the local spec)",
        upstream="megatron/core/tensor_parallel/layers.py:1480 (0.16.1: 1294) RowParallelLinear "
        "passes its output through reduce_from_tensor_model_parallel_region, whose "
        "_ReduceFromModelParallelRegion (mappings.py:221-237) returns a one-rank group's input "
        "as is: autograd marks that output a view created in a custom Function, and "
        "transformer/mlp.py:354 (0.16.1: 247) adds an expert's bias to linear_fc2's output in "
        "place (RuntimeError 'Output 0 of _ReduceFromModelParallelRegion is a view and is being "
        "modified inplace': a MoE layer with expert biases, e.g. gpt-oss, on the local spec "
        "with TP=1 and no expert parallelism)",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.tensor_parallel.layers",
                   "reduce_from_tensor_model_parallel_region", _make_tp1_reduce,
                   params=("input_", "group")),
        ),
    ),
)
