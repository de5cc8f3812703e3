"""Regenerate ``patches/megatron-core-<version>/*.patch`` from the source edits below.

Each runtime patch of :mod:`megatron_hcp.patching` has one fork-style edit here: exact text
replacements in megatron-core's files (or a new file) that make the same change in source form.
Edits differ between releases only where upstream's text did (``VERSION_EDITS``). One run writes
the diffs of every supported version; the base of a version is the installed megatron-core when
it is that version, else that release's wheel fetched with ``pip download`` (or ``--source``):

    .venv/bin/python patches/generate.py [--version 0.19.2 [--source PATH/TO/megatron]]

Every edit must match exactly once, so a new upstream release fails loudly here instead of
producing a diff that does not apply. The header of each diff records the digest of the runtime
patch's source (``Runtime-Digest``) and of the diff body (``Diff-Digest``); the drift test fails
when either side changes without regenerating.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_hcp.patching import by_name, mla  # noqa: E402
from megatron_hcp.patching import cpu_runtime as cpu  # noqa: E402
from megatron_hcp.patching.forkpatch import (  # noqa: E402
    diff_digest,
    megatron_package_dir,
    runtime_digest,
    series_for,
)
from megatron_hcp.patching.integration import CP_TOKEN_COUNTS, PER_TOKEN_COUNTS  # noqa: E402
from megatron_hcp.patching.registry import megatron_core_version  # noqa: E402

VERSIONS = ("0.16.1", "0.19.2")
NEW_FILE = object()


def _cpu_runtime_module() -> str:
    """megatron/core/cpu_runtime.py: the CPU view of torch, the same code as the runtime's."""
    parts = [inspect.getsource(obj) for obj in (
        cpu._cpu_device, cpu._factory_on_cpu, cpu._NoStream, cpu._CpuCuda, cpu.CpuDeviceTorch)]
    factories = " ".join(sorted(cpu._FACTORIES))
    head = textwrap.dedent(f'''\
        """CPU/gloo runtime for megatron-core (fork patch from megatron-hcp).

        ``cpu_torch_view(torch)`` is the ``torch`` module as one megatron-core module sees it
        without CUDA: ``torch.cuda.current_device()`` is the CPU, tensor factories asked for a
        CUDA device allocate on the CPU, CUDA streams and ``synchronize`` are no-ops, and the
        CUDA RNG is the CPU generator. Modules opt in at their end when CUDA is unavailable.
        """

        from __future__ import annotations

        import contextlib
        from typing import Any

        import torch

        _FACTORIES = frozenset("{factories}".split())


        ''')
    tail = "\n\ndef cpu_torch_view(real: Any) -> CpuDeviceTorch:\n    return CpuDeviceTorch(real)\n"
    return head + "\n\n".join(parts) + tail


def _view_tail(name: str, summary: str, extra: str = "") -> str:
    return (f"\n\n# megatron-hcp {name}: {summary}\n"
            "if not torch.cuda.is_available():\n"
            "    from megatron.core.cpu_runtime import cpu_torch_view\n\n"
            "    torch = cpu_torch_view(torch)\n" + extra)


def _append(path: str, text: str) -> tuple[str, str, str]:
    return (path, "<<END>>", text)


def _no_cp_group(name: str) -> str:
    """A stand-in CP group of one rank (no CP), appended to the module a patch edits."""
    return (f'''

class _NoCPGroup:
    """megatron-hcp {name}: a CP group of one rank (no CP)."""
''' + '''
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0
''')


_ROPE_LAYOUT_HELPERS = '''

# megatron-hcp rope-cp-partition-mode: the CP layout of a model config, and packed RoPE in the
# contiguous layout
def cp_partition_mode_of(config) -> str:
    """``config.cp_partition_mode`` ("zigzag" when the config has none)."""
    mode = getattr(config, "cp_partition_mode", None) or "zigzag"
    if mode not in ("zigzag", "contiguous"):
        raise ValueError(f"cp_partition_mode={mode!r}: use one of zigzag, contiguous")
    return mode


class _NoCPGroupForRoPE:
    """A CP group of one rank (no CP)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _apply_rotary_pos_emb_thd_contiguous(t, freqs, config, cu_seqlens, mscale, cp_group):
    """RoPE of this rank's contiguous slices: the whole packed batch rotated without CP (with
    this rank's slices in place), and the slices taken back."""
    if config.apply_rope_fusion:
        raise ValueError(
            "apply_rope_fusion=True with cp_partition_mode='contiguous': Transformer "
            "Engine's fused THD RoPE cuts sequences zigzag; set apply_rope_fusion=False"
        )
    cp, rank = cp_group.size(), cp_group.rank()
    bounds = [int(x) for x in cu_seqlens.tolist()]
    pieces = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (end - start) % cp:
            raise ValueError(
                f"sequence {i} has length {end - start}, not a multiple of {cp} (the "
                f"contiguous layout over cp_size={cp})"
            )
        size = (end - start) // cp
        pieces.append(torch.arange(start + rank * size, start + (rank + 1) * size))
    idx = torch.cat(pieces).to(t.device) if pieces else torch.zeros(0, dtype=torch.long)
    whole = t.new_zeros((bounds[-1], *t.shape[1:])).index_copy(0, idx, t)
    out = apply_rotary_pos_emb(whole, freqs, config, cu_seqlens, mscale, _NoCPGroupForRoPE())
    return out.index_select(0, idx)
'''


def _mla_tp_group_edits(fused: bool) -> list:
    """mla-tp-group: MLA's groupless q / kv gathers and SP scatters over the module's own TP
    group (``fused``: 0.19.2's FusedMLASelfAttention down projection too)."""
    path = "megatron/core/transformer/multi_latent_attention.py"
    mark = "# megatron-hcp mla-tp-group: over this module's own TP group"
    edits = [
        (path,
         "            if q_compressed.size(-1) != self.config.q_lora_rank:\n"
         "                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)\n"
         "                if self.config.sequence_parallel:\n"
         "                    q_compressed = scatter_to_sequence_parallel_region(q_compressed)\n",
         "            if q_compressed.size(-1) != self.config.q_lora_rank:\n"
         f"                {mark}\n"
         "                q_compressed = gather_from_tensor_model_parallel_region(\n"
         "                    q_compressed, group=self.pg_collection.tp\n"
         "                )\n"
         "                if self.config.sequence_parallel:\n"
         "                    q_compressed = scatter_to_sequence_parallel_region(\n"
         "                        q_compressed, group=self.pg_collection.tp\n"
         "                    )\n"),
        (path,
         "            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)\n",
         f"            {mark}\n"
         "            kv_combined = gather_from_tensor_model_parallel_region(\n"
         "                kv_combined, group=self.pg_collection.tp\n"
         "            )\n"),
        (path,
         "                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)\n",
         f"                {mark}\n"
         "                kv_compressed = scatter_to_sequence_parallel_region(\n"
         "                    kv_compressed, group=self.pg_collection.tp\n"
         "                )\n"),
    ]
    if fused:
        edits.append((
            path,
            "        if is_tensor_parallel:\n"
            "            q_compressed = gather_from_tensor_model_parallel_region(q_compressed)\n"
            "            if self.config.sequence_parallel:\n"
            "                q_compressed = scatter_to_sequence_parallel_region(q_compressed)\n",
            "        if is_tensor_parallel:\n"
            f"            {mark}\n"
            "            q_compressed = gather_from_tensor_model_parallel_region(\n"
            "                q_compressed, group=self.pg_collection.tp\n"
            "            )\n"
            "            if self.config.sequence_parallel:\n"
            "                q_compressed = scatter_to_sequence_parallel_region(\n"
            "                    q_compressed, group=self.pg_collection.tp\n"
            "                )\n"))
    return edits


def _model_groups_module() -> str:
    """mtp-collection-groups: the model's groups in context and megatron's parallel_state as
    multi_token_prediction sees it - the runtime's own classes - put before mtp_on_this_rank
    (the module's end is cpu-mtp-loss-tracker's: each diff applies alone)."""
    parts = [inspect.getsource(obj) for obj in (mla.ModelGroups, mla._CollectionParallelState)]
    return textwrap.dedent('''\
        # megatron-hcp mtp-collection-groups: the process groups of the model being built or run
        # (GPTModel enters them); where megatron has no global groups (decentralized process
        # groups), its pipeline stage and its data-parallel group come from its own collection
        ''') + parts[0] + textwrap.dedent('''\


        _MODEL_GROUPS = contextvars.ContextVar("megatron_hcp_model_groups", default=None)


        @contextlib.contextmanager
        def model_groups(pg_collection, vp_size=None):
            """Inside: the pipeline stage and data-parallel group of the model come from
            ``pg_collection`` where megatron's global groups are not initialized."""
            token = _MODEL_GROUPS.set(
                None if pg_collection is None else ModelGroups(pg_collection, vp_size)
            )
            try:
                yield
            finally:
                _MODEL_GROUPS.reset(token)


        ''') + parts[1] + "\n\nparallel_state = _CollectionParallelState(parallel_state)\n\n\n"


def _indented(text: str, by: str = "    ") -> str:
    return "".join(by + line if line.strip() else line for line in text.splitlines(True))


_MTP_LOSS_CALL = """\
                hidden_states = process_mtp_loss(
                    hidden_states=hidden_states,
                    labels=labels,
                    loss_mask=loss_mask,
                    output_layer=self.output_layer,
                    output_weight=output_weight,
                    runtime_gather_output=runtime_gather_output,
                    is_training=self.training,
                    compute_language_model_loss=self.compute_language_model_loss,
                    config=self.config,
                    cp_group=self.pg_collection.cp,
                    tp_group=self.tp_group,
                    packed_seq_params=packed_seq_params,
                    scale_logits_fn=self._scale_logits if self.config.use_mup else None,
                    input_ids=input_ids,
                )
"""
_MTP_ON_THIS_RANK = """\
        self.mtp_process = mtp_block_spec is not None and mtp_on_this_rank(
            layout=self.config.pipeline_model_parallel_layout,
            mtp_num_layers=self.config.mtp_num_layers,
            ignore_virtual=False,
            vp_stage=vp_stage,
        )
"""


def _torch_view_edit(name: str) -> list:
    """The CPU view of torch appended to every module a patch views (each of its targets)."""
    patch = by_name([name])[0]
    return [_append(t.module.replace(".", "/") + ".py", _view_tail(name, patch.summary))
            for t in patch.targets]


def _moe_allgather_edits() -> list:
    """moe-allgather-variable-tokens: the all-gather dispatcher with expert-parallel ranks of
    different token counts gathers and reduce-scatters padded equal shares (same text on
    0.16.1 and 0.19.2). Inside the module, not at its end (cpu-moe-alltoall-dispatcher's)."""
    path = "megatron/core/transformer/moe/token_dispatcher.py"
    name = "moe-allgather-variable-tokens"
    return [
        (path,
         "class MoEAllGatherTokenDispatcher(MoETokenDispatcher):\n",
         f'''# megatron-hcp {name}: expert-parallel peers are data-parallel (DPxCP)
# ranks, whose micro-batches differ in length with variable-length data (packed rows, dynamic
# CP); the all-gather dispatcher then gathers and reduce-scatters padded equal shares
def _token_counts(count, group, device):
    """Every rank's ``count`` over ``group``, in group order."""
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = torch.empty(group.size(), dtype=torch.int64, device=device)
    torch.distributed.all_gather_into_tensor(every, mine, group=group)
    return every.tolist()


def _padded(tensor, rows):
    """``tensor`` ([n, ...]) with zero rows appended up to ``rows``."""
    extra = rows - tensor.shape[0]
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
'''),
        (path,
         "        self.global_local_map = None\n",
         "        self.global_local_map = None\n"
         f"        # megatron-hcp {name}: of a dispatch of padded shares, (its real\n"
         "        # rows in the padded layout, this rank's token count, a share), else None\n"
         "        self.padded_token_rows = None\n"),
        (path,
         '''    def token_dispatch(self, hidden_states, probs):
        """Gathers tokens from all TP*EP ranks using AllGather."""

        # Permute the tokens across the expert parallel devices.
''',
         f'''    def token_dispatch(self, hidden_states, probs):
        """Gathers tokens from all TP*EP ranks using AllGather."""

        # megatron-hcp {name}: expert-parallel ranks holding different
        # token counts gather padded equal shares (TP x SP shares alone are equal)
        self.padded_token_rows = None
        if self.ep_size > 1:
            counts = _token_counts(hidden_states.shape[0], self.tp_ep_group, hidden_states.device)
            if len(set(counts)) > 1:
                return self._token_dispatch_padded(hidden_states, probs, counts)

        # Permute the tokens across the expert parallel devices.
'''),
        (path,
         "        return hidden_states, probs\n\n"
         "    def dispatch_postprocess(self, hidden_states, probs):\n",
         f'''        return hidden_states, probs

    def _token_dispatch_padded(self, hidden_states, probs, counts):
        """megatron-hcp {name}: each rank's share padded to the largest
        of ``counts``, gathered as equal shares over TP*EP, the padding rows dropped: the experts
        see the concatenation of every rank's tokens, as the gather of equal shares gives."""
        most = max(counts)
        rows = torch.cat(
            [torch.arange(n, device=hidden_states.device) + i * most for i, n in enumerate(counts)]
        )
        self.padded_token_rows = (rows, hidden_states.shape[0], most)

        def gather(tensor):
            tensor = _padded(tensor, most)
            return gather_from_sequence_parallel_region(tensor, group=self.tp_ep_group)[rows]

        with torch.no_grad():
            self.routing_map = gather(self.routing_map)
        return gather(hidden_states), gather(probs)

    def dispatch_postprocess(self, hidden_states, probs):
'''),
        (path,
         "        # Unpermute the tokens across ranks.\n"
         "        if self.tp_size > 1 or self.ep_size > 1:\n"
         "            hidden_states = reduce_scatter_to_sequence_parallel_region(\n",
         f'''        # megatron-hcp {name}: after a dispatch of padded shares, the
        # experts' output put back into the padded layout, reduce-scattered, this rank's rows kept
        if self.padded_token_rows is not None:
            rows, local, most = self.padded_token_rows
            self.padded_token_rows = None
            values = hidden_states.to(self.local_probs.dtype)
            full = values.new_zeros((most * self.tp_ep_group.size(), *values.shape[1:]))
            full = full.index_copy(0, rows, values)
            out = reduce_scatter_to_sequence_parallel_region(full, group=self.tp_ep_group)
            return out[:local].to(hidden_states.dtype)
        # Unpermute the tokens across ranks.
        if self.tp_size > 1 or self.ep_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
'''),
    ]


_MLA_DYNAMIC_CP_HELPERS = '''

# megatron-hcp mla-dynamic-cp-group: the CP group of a dynamic-CP micro-batch
def _dynamic_cp_group(packed_seq_params):
    """(dynamic?, the micro-batch's own CP group): dynamic when ``packed_seq_params`` sets
    ``local_cp_size`` or ``cp_group``; group None means no CP (``local_cp_size == 1``).
    Inconsistent fields raise (never a silent fallback to the static group)."""
    local = getattr(packed_seq_params, "local_cp_size", None)
    group = getattr(packed_seq_params, "cp_group", None)
    if local is None and group is None:
        return False, None
    if group is None:
        if local == 1:
            return True, None
        raise RuntimeError(
            f"packed_seq_params.local_cp_size={local} but packed_seq_params.cp_group is None: "
            "dynamic CP must hand over the micro-batch's CP group (local_cp_size 1 alone "
            "means no CP)"
        )
    size = torch.distributed.get_world_size(group)
    if local is not None and local != size:
        raise RuntimeError(
            f"packed_seq_params.local_cp_size={local} but its cp_group has {size} ranks"
        )
    return True, group


class _NoCPGroup:
    """A CP group of one rank (no CP)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0
'''


def _mla_dynamic_cp_edits() -> list:
    """mla-dynamic-cp-group: MLA's forward runs a dynamic-CP micro-batch with its own group as
    the module's CP group (upstream's forward becomes ``_forward``), its q / k / v without the
    ``local_cp_size`` MLA refuses and with the whole RoPE table (same text on 0.16.1 and
    0.19.2)."""
    path = "megatron/core/transformer/multi_latent_attention.py"
    mark = "megatron-hcp mla-dynamic-cp-group"
    return [
        (path,
         "import math\nfrom dataclasses import dataclass\n",
         f"import dataclasses  # {mark}\nimport math\nfrom dataclasses import dataclass\n"),
        (path,
         '        """Forward pass for multi-latent attention"""\n',
         f'''        """Forward pass for multi-latent attention"""
        # {mark}: a dynamic-CP micro-batch (its own CP group in
        # packed_seq_params.cp_group; local_cp_size 1 without a group: no CP) runs with that group
        # as this module's CP group (RoPE of q and k; the core attention takes the micro-batch's
        # PackedSeqParams as they are), the static group restored after
        dynamic_cp, cp_group = _dynamic_cp_group(packed_seq_params)
        args = (
            hidden_states,
            attention_mask,
            key_value_states,
            inference_context,
            rotary_pos_emb,
            rotary_pos_cos,
            rotary_pos_sin,
            rotary_pos_cos_sin,
            attention_bias,
            packed_seq_params,
            position_ids,
            sequence_len_offset,
        )
        if not dynamic_cp:
            return self._forward(*args, inference_params=inference_params)
        static_cp_group = self.pg_collection.cp
        self.pg_collection.cp = cp_group if cp_group is not None else _NoCPGroup()
        try:
            return self._forward(*args, inference_params=inference_params, dynamic_cp=True)
        finally:
            self.pg_collection.cp = static_cp_group

    def _forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states,
        inference_context,
        rotary_pos_emb,
        rotary_pos_cos,
        rotary_pos_sin,
        rotary_pos_cos_sin,
        attention_bias,
        packed_seq_params,
        position_ids,
        sequence_len_offset,
        *,
        inference_params,
        dynamic_cp=False,
    ):
        """Upstream's forward; ``dynamic_cp``: a dynamic-CP micro-batch, its group
        ``self.pg_collection.cp`` for the call ({mark})."""
'''),
        (path,
         "                packed_seq_params,\n"
         "                inference_context=inference_context,\n"
         "            )\n",
         f"                # {mark}: a dynamic-CP micro-batch's group is the\n"
         "                # module's for the call (local_cp_size, which MLA refuses, left out)\n"
         "                (\n"
         "                    dataclasses.replace(packed_seq_params, local_cp_size=None)\n"
         "                    if dynamic_cp\n"
         "                    else packed_seq_params\n"
         "                ),\n"
         "                inference_context=inference_context,\n"
         "            )\n"),
        (path,
         "                elif packed_seq_params is None or self.config.context_parallel_size == 1:\n",
         f"                # {mark}: a dynamic-CP micro-batch (cp_group set)\n"
         "                # keeps the whole table when its group (the module's for the call) has\n"
         "                # several ranks\n"
         "                elif packed_seq_params is None or (\n"
         "                    self.config.context_parallel_size == 1\n"
         "                    and (packed_seq_params.cp_group is None or self.pg_collection.cp.size() == 1)\n"
         "                ):\n"),
        _append(path, _MLA_DYNAMIC_CP_HELPERS),
    ]

_MOE_ROUTER_HELPERS = '''
# megatron-hcp moe-router-dynamic-cp-group: a MoE router's load-balancing and z-losses of a
# dynamic-CP micro-batch (its own CP group in packed_seq_params.cp_group; local_cp_size 1
# without a group: no CP) over the micro-batch's group, not the static TP x CP group
class _NoCPGroup:
    """A CP group of one rank (no CP)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _router_group_uses(config):
    """What a MoE router of config computes over its TP x CP group."""
    if not config.num_moe_experts:
        return []
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    elif not isinstance(coeffs, (list, tuple)):
        coeffs = [coeffs] * len(types)
    uses = [
        t
        for t, c in zip(types, coeffs)
        if t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and (c or 0) > 0
    ]
    if config.moe_z_loss_coeff:
        uses.append("z_loss")
    if "quantile_balancing" in types:
        uses.append("quantile_balancing")
    return uses


def _router_problems(config, uses):
    """Why the router cannot run a dynamic-CP micro-batch on the micro-batch's group."""
    problems = []
    if config.tensor_model_parallel_size > 1:
        problems.append(
            f"tensor_model_parallel_size={config.tensor_model_parallel_size}: the router's "
            f"{uses} would reduce over TP x the micro-batch's CP group, which does not exist; "
            "use TP 1 (expert parallelism instead) or set the losses' coefficients to 0"
        )
    if "global_aux_loss" in uses:
        problems.append(
            "moe_router_load_balancing_type=global_aux_loss assumes every rank holds as many "
            "tokens, which dynamic CP's micro-batches do not; use aux_loss or seq_aux_loss"
        )
    if getattr(config, "moe_layer_recompute", False) or (
        config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or [])
    ):
        problems.append(
            f"recompute_modules={config.recompute_modules}: selective recompute of moe reruns "
            "the router in backward, after the micro-batch's CP group was given back; drop moe "
            "(moe_act or full recompute work)"
        )
    return problems


def _router_on_micro_batch_group(layer, args, kwargs):
    """(router, static group, the micro-batch's group) of a dynamic-CP micro-batch through a
    layer whose MoE router computes over its group; None otherwise."""
    router = getattr(getattr(layer, "mlp", None), "router", None)
    uses = _router_group_uses(layer.config) if router is not None else []
    if not uses:
        return None
    if "packed_seq_params" in kwargs or not args:
        params = kwargs.get("packed_seq_params")
    else:
        signature = inspect.signature(type(layer)._forward_attention)
        params = signature.bind_partial(layer, *args, **kwargs).arguments.get(
            "packed_seq_params"
        )
    local = getattr(params, "local_cp_size", None)
    group = getattr(params, "cp_group", None)
    if local is None and group is None:
        return None
    if group is None and local != 1:
        raise RuntimeError(
            f"packed_seq_params.local_cp_size={local} but packed_seq_params.cp_group is None"
        )
    problems = _router_problems(layer.config, uses)
    if problems:
        raise ValueError("MoE router under dynamic CP: " + "; ".join(problems))
    return router, router.tp_cp_group, group if group is not None else _NoCPGroup()


def _tracked_back(swapped, static):
    """MoE metrics last recorded over swapped reduce over static again when logged."""
    from megatron.core.transformer.moe.{tracker_module} import {tracker_function}

    for entry in {tracker_function}(){tracker_values}:
        if {tracker_get} is swapped:
            {tracker_set}


'''

_MOE_ROUTER_FORWARD = '''    def forward(self, *args, **kwargs):
        """
        Perform a forward pass through the transformer layer.

        megatron-hcp moe-router-dynamic-cp-group: a dynamic-CP micro-batch's MoE router computes
        its losses over the micro-batch's CP group (the static group restored after, also for
        the metrics logged).
        """
        swap = _router_on_micro_batch_group(self, args, kwargs)
        if swap is None:
            return self._forward_layer(*args, **kwargs)
        router, static, group = swap
        router.tp_cp_group = group
        try:
            return self._forward_layer(*args, **kwargs)
        finally:
            router.tp_cp_group = static
            _tracked_back(group, static)

    def _forward_layer(self, *args, **kwargs):
        """
        Perform a forward pass through the transformer layer.
'''


def _moe_router_edits(version: str) -> list:
    """moe-router-dynamic-cp-group: ``TransformerLayer.forward`` runs a dynamic-CP micro-batch
    with the MoE router's ``tp_cp_group`` the micro-batch's CP group (upstream's forward becomes
    ``_forward_layer``); the metrics tracker's entries get the static group back."""
    path = "megatron/core/transformer/transformer_layer.py"
    if version == "0.16.1":
        tracker = {"tracker_module": "moe_utils",
                   "tracker_function": "get_moe_layer_wise_logging_tracker",
                   "tracker_values": ".values()", "tracker_get": 'entry.get("reduce_group")',
                   "tracker_set": 'entry["reduce_group"] = static'}
    else:
        tracker = {"tracker_module": "moe_logging", "tracker_function": "get_moe_metrics_tracker",
                   "tracker_values": "._metrics.values()", "tracker_get": "entry.reduce_group",
                   "tracker_set": "entry.reduce_group = static"}
    helpers = _MOE_ROUTER_HELPERS
    for key, value in tracker.items():
        helpers = helpers.replace("{" + key + "}", value)
    return [
        (path, "import functools\nimport logging\n",
         "import functools\nimport inspect  # megatron-hcp moe-router-dynamic-cp-group\n"
         "import logging\n"),
        (path, "\n@dataclass\nclass TransformerLayerSubmodules:\n",
         helpers + "@dataclass\nclass TransformerLayerSubmodules:\n"),
        (path,
         '    def forward(self, *args, **kwargs):\n        """\n'
         '        Perform a forward pass through the transformer layer.\n',
         _MOE_ROUTER_FORWARD),
    ]


EDITS: dict[str, list] = {
    # ------------------------------------------------------------------ CPU runtime
    "cpu-schedules-device": [("megatron/core/cpu_runtime.py", NEW_FILE, _cpu_runtime_module()),
                             *_torch_view_edit("cpu-schedules-device")],
    "cpu-p2p-device": _torch_view_edit("cpu-p2p-device"),
    "cpu-global-memory-buffer": _torch_view_edit("cpu-global-memory-buffer"),
    "cpu-ddp-buffers": _torch_view_edit("cpu-ddp-buffers"),
    "cpu-rope-device": _torch_view_edit("cpu-rope-device"),
    "cpu-attention-masks": _torch_view_edit("cpu-attention-masks"),
    "cpu-optimizer-device": _torch_view_edit("cpu-optimizer-device"),
    "cpu-grad-norm-device": _torch_view_edit("cpu-grad-norm-device"),
    "cpu-mtp-loss-tracker": _torch_view_edit("cpu-mtp-loss-tracker"),
    "cpu-timers": _torch_view_edit("cpu-timers"),
    "cpu-dist-checkpointing": _torch_view_edit("cpu-dist-checkpointing"),
    "cpu-ddp-wrap": _torch_view_edit("cpu-ddp-wrap"),
    "cpu-moe-router-device": _torch_view_edit("cpu-moe-router-device"),
    "moe-router-gating-without-te": [(
        "megatron/core/transformer/moe/moe_utils.py",
        "    HAVE_TE = True\nexcept ImportError:\n    HAVE_TE = False\n",
        "    HAVE_TE = True\nexcept ImportError:\n    HAVE_TE = False\n"
        "    # megatron-hcp moe-router-gating-without-te: the router's gating takes the torch\n"
        "    # branch (te_general_gemm was left undefined: NameError)\n"
        "    te_general_gemm = None\n")],
    "cpu-moe-alltoall-dispatcher": [_append(
        "megatron/core/transformer/moe/token_dispatcher.py",
        _view_tail("cpu-moe-alltoall-dispatcher",
                   by_name(["cpu-moe-alltoall-dispatcher"])[0].summary, '''
    _upstream_maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        """Upstream's, and a CPU tensor asked for ``as_numpy`` becomes a NumPy array too (the
        split sizes all_to_all_single takes, as on a GPU)."""
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy().copy()
        return _upstream_maybe_move_tensor_to_cpu(
            tensor, as_numpy=as_numpy, record_stream=record_stream
        )
'''))],
    "mla-without-te": [(
        "megatron/core/transformer/multi_latent_attention.py",
        "    HAVE_TE = True\nexcept ImportError:\n",
        "    HAVE_TE = True\n"
        "    # megatron-hcp mla-without-te: the TE extension also imports without Transformer\n"
        "    # Engine, with MagicMock classes that isinstance() rejects\n"
        "    from megatron.core.extensions.transformer_engine import HAVE_TE as _TE_PRESENT\n"
        "\n"
        "    if not _TE_PRESENT:\n"
        "\n"
        "        class TELinear:  # nothing is an instance of it\n"
        "            pass\n"
        "\n"
        "except ImportError:\n")],
    "cpu-sequence-parallel": [
        _append(f"megatron/core/tensor_parallel/{name}.py",
                _view_tail("cpu-sequence-parallel", by_name(["cpu-sequence-parallel"])[0].summary))
        for name in ("mappings", "layers")],
    "cpu-rope-cp-index": [(
        "megatron/core/models/common/embeddings/rope_utils.py",
        '''    cp_idx = torch.tensor(
        [cp_rank, (2 * cp_size - cp_rank - 1)], device="cpu", pin_memory=True
    ).cuda(non_blocking=True)
''',
        '''    # megatron-hcp cpu-rope-cp-index: index on the embedding's own device (no pinned memory
    # or .cuda(): the CPU/gloo runtime has neither)
    cp_idx = torch.tensor([cp_rank, (2 * cp_size - cp_rank - 1)], device=pos_emb.device)
''')],
    "cpu-rng-tracker": [_append(
        "megatron/core/tensor_parallel/random.py",
        _view_tail("cpu-rng-tracker", by_name(["cpu-rng-tracker"])[0].summary, '''
    def _get_cuda_rng_state(device=-1, clone=False, graph_safe=False):
        """The 'device' RNG state is the CPU generator's under the CPU runtime."""
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)
'''))],
    "cpu-tied-embedding-sync": [(
        "megatron/core/models/common/language_module/language_module.py",
        "                weight.data = weight.data.cuda()\n",
        "                # megatron-hcp cpu-tied-embedding-sync: all-reduce where the weight lives\n"
        "                if torch.cuda.is_available():\n"
        "                    weight.data = weight.data.cuda()\n")],
    # ------------------------------------------------------------------ integration
    "attention-dynamic-cp-rope": [
        ("megatron/core/transformer/attention.py",
         "            q_pos_emb, k_pos_emb = rotary_pos_emb\n\n"
         "            if packed_seq_params is not None and packed_seq_params.qkv_format == 'thd':\n"
         "                if packed_seq_params.cu_seqlens_q_padded is not None:\n",
         "            q_pos_emb, k_pos_emb = rotary_pos_emb\n"
         "            # megatron-hcp attention-dynamic-cp-rope: a dynamic-CP micro-batch brings its\n"
         "            # own CP group (local_cp_size 1 without a group: no CP)\n"
         "            rope_cp_group = self.pg_collection.cp\n"
         "            if packed_seq_params is not None and packed_seq_params.cp_group is not None:\n"
         "                rope_cp_group = packed_seq_params.cp_group\n"
         "            elif packed_seq_params is not None and packed_seq_params.local_cp_size == 1:\n"
         "                rope_cp_group = _NoCPGroup()\n\n"
         "            if packed_seq_params is not None and packed_seq_params.qkv_format == 'thd':\n"
         "                if packed_seq_params.cu_seqlens_q_padded is not None:\n"),
        ("megatron/core/transformer/attention.py",
         "                            cu_seqlens=cu_seqlens_q,\n"
         "                            mscale=_yarn_get_concentration_factor_from_config(self.config),\n"
         "                            cp_group=self.pg_collection.cp,\n",
         "                            cu_seqlens=cu_seqlens_q,\n"
         "                            mscale=_yarn_get_concentration_factor_from_config(self.config),\n"
         "                            cp_group=rope_cp_group,\n"),
        ("megatron/core/transformer/attention.py",
         "                            query, q_pos_emb, self.config, cu_seqlens_q, self.pg_collection.cp\n",
         "                            query, q_pos_emb, self.config, cu_seqlens_q, rope_cp_group\n"),
        ("megatron/core/transformer/attention.py",
         "                        cu_seqlens=cu_seqlens_kv,\n"
         "                        mscale=_yarn_get_concentration_factor_from_config(self.config),\n"
         "                        cp_group=self.pg_collection.cp,\n",
         "                        cu_seqlens=cu_seqlens_kv,\n"
         "                        mscale=_yarn_get_concentration_factor_from_config(self.config),\n"
         "                        cp_group=rope_cp_group,\n"),
        _append("megatron/core/transformer/attention.py",
                _no_cp_group("attention-dynamic-cp-rope")),
    ],
    "rope-cp-partition-mode": [
        ("megatron/core/models/gpt/gpt_model.py",
         "                use_cpu_initialization=self.config.use_cpu_initialization,\n"
         "                cp_group=self.pg_collection.cp,\n"
         "            )\n\n"
         "        elif self.position_embedding_type == 'yarn':\n",
         "                use_cpu_initialization=self.config.use_cpu_initialization,\n"
         "                cp_group=self.pg_collection.cp,\n"
         "            )\n"
         "            # megatron-hcp rope-cp-partition-mode: the table knows the CP layout\n"
         "            from megatron.core.models.common.embeddings.rope_utils import (\n"
         "                cp_partition_mode_of,\n"
         "            )\n\n"
         "            self.rotary_pos_emb.cp_partition_mode = cp_partition_mode_of(self.config)\n\n"
         "        elif self.position_embedding_type == 'yarn':\n"),
        ("megatron/core/models/common/embeddings/rotary_pos_embedding.py",
         "        emb = self.get_emb(max_seq_len, offset)\n"
         "        if cp_group is None:\n"
         "            cp_group = self.cp_group\n"
         "        if cp_group is not None and cp_group.size() > 1 and not packed_seq:\n"
         "            # slice rotary_pos_emb along sequence dimension\n"
         "            # and select the parition of the current CP rank\n"
         "            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)\n",
         "        emb = self.get_emb(max_seq_len, offset)\n"
         "        if cp_group is None:\n"
         "            cp_group = self.cp_group\n"
         "        contiguous = getattr(self, 'cp_partition_mode', 'zigzag') == 'contiguous'\n"
         "        if cp_group is not None and cp_group.size() > 1 and not packed_seq and contiguous:\n"
         "            # megatron-hcp rope-cp-partition-mode: the rank's contiguous slice\n"
         "            if emb.shape[0] % cp_group.size():\n"
         "                raise ValueError(\n"
         "                    f'RoPE table of {emb.shape[0]} positions cannot be cut into '\n"
         "                    f'{cp_group.size()} contiguous slices: the sequence length must be a '\n"
         "                    'multiple of the CP size'\n"
         "                )\n"
         "            emb = emb.chunk(cp_group.size(), dim=0)[cp_group.rank()]\n"
         "        elif cp_group is not None and cp_group.size() > 1 and not packed_seq:\n"
         "            # slice rotary_pos_emb along sequence dimension\n"
         "            # and select the parition of the current CP rank\n"
         "            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)\n"),
        ("megatron/core/models/common/embeddings/rope_utils.py",
         "    # Keep for backward compatibility. Will deprecate in the future.\n"
         "    if cp_group is None:\n"
         "        cp_group = parallel_state.get_context_parallel_group()\n",
         "    # Keep for backward compatibility. Will deprecate in the future.\n"
         "    if cp_group is None:\n"
         "        cp_group = parallel_state.get_context_parallel_group()\n"
         "    # megatron-hcp rope-cp-partition-mode: packed input in the contiguous layout\n"
         "    if (cu_seqlens is not None and cp_group.size() > 1\n"
         "            and cp_partition_mode_of(config) == 'contiguous'):\n"
         "        return _apply_rotary_pos_emb_thd_contiguous(t, freqs, config, cu_seqlens, mscale, cp_group)\n"),
        _append("megatron/core/models/common/embeddings/rope_utils.py", _ROPE_LAYOUT_HELPERS),
    ],
    "cross-entropy-model-tp-group": [
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):\n"
         '        """Vocab parallel cross entropy forward function."""\n',
         "    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):\n"
         '        """Vocab parallel cross entropy forward function.\n\n'
         '        megatron-hcp cross-entropy-model-tp-group: over ``tp_group`` (default: MPU TP).\n'
         '        """\n'
         "        if tp_group is None:\n"
         "            tp_group = get_tensor_model_parallel_group()\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "            logits_max, op=torch.distributed.ReduceOp.MAX, group=get_tensor_model_parallel_group()\n",
         "            logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "        rank = get_tensor_model_parallel_rank()\n"
         "        world_size = get_tensor_model_parallel_world_size()\n",
         "        rank = torch.distributed.get_rank(tp_group)\n"
         "        world_size = torch.distributed.get_world_size(tp_group)\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "            predicted_logits,\n"
         "            op=torch.distributed.ReduceOp.SUM,\n"
         "            group=get_tensor_model_parallel_group(),\n",
         "            predicted_logits,\n"
         "            op=torch.distributed.ReduceOp.SUM,\n"
         "            group=tp_group,\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "            sum_exp_logits,\n"
         "            op=torch.distributed.ReduceOp.SUM,\n"
         "            group=get_tensor_model_parallel_group(),\n",
         "            sum_exp_logits,\n"
         "            op=torch.distributed.ReduceOp.SUM,\n"
         "            group=tp_group,\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "        return grad_input, None, None\n",
         "        return grad_input, None, None, None  # no gradient for tp_group\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):\n",
         "def vocab_parallel_cross_entropy(\n"
         "    vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None\n"
         "):\n"),
        ("megatron/core/tensor_parallel/cross_entropy.py",
         "    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)\n",
         "    return _VocabParallelCrossEntropy.apply(\n"
         "        vocab_parallel_logits, target, label_smoothing, tp_group\n"
         "    )\n"),
        ("megatron/core/models/common/language_module/language_module.py",
         "            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)\n",
         "            # megatron-hcp cross-entropy-model-tp-group: the model's own TP group\n"
         "            loss = tensor_parallel.vocab_parallel_cross_entropy(\n"
         "                logits, labels, tp_group=self.pg_collection.tp\n"
         "            )\n"),
    ],
    "destroy-forgets-stale-groups": [(
        "megatron/core/parallel_state.py",
        "    global _global_process_group_list\n    _global_process_group_list = None\n",
        '''    # megatron-hcp destroy-forgets-stale-groups: destroy the groups created above and reset
    # what the resets above miss (a re-initialization would otherwise see destroyed groups and
    # stale rank lists; leaked gloo groups keep threads and sockets)
    global _global_process_group_list
    global _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS, _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    global _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS
    global _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP, _EMBEDDING_GLOBAL_RANKS
    global _EXPERT_MODEL_PARALLEL_RANKS, _MODEL_PARALLEL_GLOBAL_RANKS, _PIPELINE_GLOBAL_RANKS
    global _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS
    _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    _DATA_PARALLEL_GLOBAL_RANKS = None
    _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = None
    _EMBEDDING_GLOBAL_RANKS = None
    _EXPERT_MODEL_PARALLEL_RANKS = None
    _MODEL_PARALLEL_GLOBAL_RANKS = None
    _PIPELINE_GLOBAL_RANKS = None
    _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = None
    _HYBRID_DP_CP_GROUPS.clear()
    live = torch.distributed.distributed_c10d._world.pg_map
    seen = set()
    for group in _global_process_group_list or []:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        if group is not torch.distributed.GroupMember.WORLD and group in live:
            torch.distributed.destroy_process_group(group)
    _global_process_group_list = None
''')],
    "te-attention-hcp": [
        ("megatron/core/extensions/transformer_engine.py",
         "            if getattr(TEDotProductAttention, \"cp_stream\") is None:\n"
         "                TEDotProductAttention.cp_stream = torch.cuda.Stream()\n",
         "            # megatron-hcp te-attention-hcp: no CUDA stream where there is no CUDA\n"
         "            if getattr(TEDotProductAttention, \"cp_stream\") is None and (\n"
         "                torch.cuda.is_available()\n"
         "            ):\n"
         "                TEDotProductAttention.cp_stream = torch.cuda.Stream()\n"),
        ("megatron/core/extensions/transformer_engine.py",
         "                    extra_kwargs[\"cp_group\"] = get_hierarchical_context_parallel_groups(\n"
         "                        check_initialized=False\n"
         "                    )\n",
         "                    # megatron-hcp te-attention-hcp: the model's hierarchical groups\n"
         "                    # (decentralized path), never silently none\n"
         "                    hcp = getattr(pg_collection, \"hcp\", None) or (\n"
         "                        get_hierarchical_context_parallel_groups(check_initialized=False)\n"
         "                    )\n"
         "                    if not hcp or len(hcp) != 2:\n"
         "                        raise RuntimeError(\n"
         "                            \"cp_comm_type=a2a+p2p but no hierarchical CP groups \"\n"
         "                            \"(pg_collection.hcp); attention would run with CP off\"\n"
         "                        )\n"
         "                    extra_kwargs[\"cp_group\"] = hcp\n"),
        ("megatron/core/extensions/transformer_engine.py",
         "        if self.config.deterministic_mode:\n"
         "            if int(os.getenv(\"NVTE_ALLOW_NONDETERMINISTIC_ALGO\", \"1\")) != 0:\n",
         "        # megatron-hcp te-attention-hcp: the constructor's CP groups, restored after a\n"
         "        # dynamic-CP micro-batch\n"
         "        self._static_cp_args = (\n"
         "            extra_kwargs.get(\"cp_group\"),\n"
         "            extra_kwargs.get(\"cp_global_ranks\"),\n"
         "            extra_kwargs.get(\"cp_stream\"),\n"
         "            extra_kwargs.get(\"cp_comm_type\", cp_comm_type or \"p2p\"),\n"
         "        )\n\n"
         "        if self.config.deterministic_mode:\n"
         "            if int(os.getenv(\"NVTE_ALLOW_NONDETERMINISTIC_ALGO\", \"1\")) != 0:\n"),
        ("megatron/core/extensions/transformer_engine.py",
         "            self.kept_packed_seq_params.discard(\"cp_group\")\n"
         "            self.kept_packed_seq_params.discard(\"local_cp_size\")\n",
         "            self.kept_packed_seq_params.discard(\"cp_group\")\n"
         "            self.kept_packed_seq_params.discard(\"local_cp_size\")\n"
         "            if packed_seq_params.cp_group is not None or (\n"
         "                packed_seq_params.local_cp_size is not None\n"
         "            ):\n"
         "                try:\n"
         "                    return self._forward_with_groups(\n"
         "                        query, key, value, attention_mask, attn_mask_type,\n"
         "                        attention_bias, packed_seq_params, num_splits,\n"
         "                    )\n"
         "                finally:  # megatron-hcp te-attention-hcp: back to the static groups\n"
         "                    super().set_context_parallel_group(*self._static_cp_args)\n"
         "        return self._forward_with_groups(\n"
         "            query, key, value, attention_mask, attn_mask_type, attention_bias,\n"
         "            packed_seq_params, num_splits,\n"
         "        )\n\n"
         "    def _forward_with_groups(\n"
         "        self, query, key, value, attention_mask, attn_mask_type, attention_bias,\n"
         "        packed_seq_params, num_splits,\n"
         "    ):\n"
         "        \"\"\"Upstream forward after the CP groups are set.\"\"\"\n"),
    ],
    "p2p-variable-seq-lengths": [
        ("megatron/core/pipeline_parallel/p2p_communication.py",
         "        config = self.config\n"
         "        tensor_recv_prev_func = None\n",
         "        config = self.config\n"
         "        if config.variable_seq_lengths or config.mtp_standalone:\n"
         "            # megatron-hcp p2p-variable-seq-lengths\n"
         "            return self._communicate_variable(\n"
         "                tensor_send_next, tensor_send_prev, recv_prev, recv_next, wait_on_reqs\n"
         "            )\n"
         "        tensor_recv_prev_func = None\n"),
        ("megatron/core/pipeline_parallel/p2p_communication.py",
         "    def _communicate(\n",
         '''    def _communicate_variable(
        self, tensor_send_next, tensor_send_prev, recv_prev, recv_next, wait_on_reqs
    ):
        """Variable sequence lengths: send shapes and tensors first, then receive.

        megatron-hcp p2p-variable-seq-lengths: exchanging every shape (blocking, tag 0) before
        any tensor deadlocks or mismatches shapes when the two stages of a PP=2 pipeline group
        their calls differently (interleaved schedule, every micro-batch in warm-up). Sends never
        wait for receives, and each kind and direction has its own tag.
        """
        group, config = self.pp_group, self.config
        sent = tensor_send_next if tensor_send_next is not None else tensor_send_prev
        # the pipeline group's device (a GPU for NCCL, the CPU for gloo), never the machine's
        if sent is not None:
            device = sent.device
        elif torch.distributed.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        works = []
        for tensor, peer, shape_tag, data_tag in (
            (tensor_send_next, self.next_rank, 11, 13),
            (tensor_send_prev, self.prev_rank, 12, 14),
        ):
            if tensor is not None:
                size = torch.tensor(tensor.size(), dtype=torch.int64, device=device)
                works.append(torch.distributed.isend(size, peer, group=group, tag=shape_tag))
                works.append(torch.distributed.isend(tensor, peer, group=group, tag=data_tag))
        received = []
        for wanted, peer, shape_tag, data_tag in (
            (recv_prev, self.prev_rank, 11, 13),
            (recv_next, self.next_rank, 12, 14),
        ):
            if not wanted:
                received.append(None)
                continue
            size = torch.empty(3, dtype=torch.int64, device=device)
            torch.distributed.irecv(size, peer, group=group, tag=shape_tag).wait()
            buf = torch.empty(
                size.tolist(), requires_grad=True, device=device, dtype=config.pipeline_dtype
            )
            works.append(torch.distributed.irecv(buf, peer, group=group, tag=data_tag))
            received.append(buf)
        for work in works:
            work.wait()
        return received[0], received[1], ([] if not wait_on_reqs else None)

    def _communicate(
'''),
    ],
    "chained-optimizer-count-zeros-tp-group": [(
        "megatron/core/optimizer/optimizer.py",
        "                params += optimizer.get_parameters()\n"
        "            return count_zeros_fp32(\n"
        "                params,\n"
        "                grad_stats_parallel_group=self.get_grad_stats_parallel_group(),\n"
        "                use_decoupled_grad=self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,\n"
        "            )\n",
        "                params += optimizer.get_parameters()\n"
        "            # megatron-hcp chained-optimizer-count-zeros-tp-group: the optimizers' TP group\n"
        "            tp_groups = {id(getattr(o, 'tp_group', None)): getattr(o, 'tp_group', None)\n"
        "                         for o in self.chained_optimizers}\n"
        "            return count_zeros_fp32(\n"
        "                params,\n"
        "                grad_stats_parallel_group=self.get_grad_stats_parallel_group(),\n"
        "                use_decoupled_grad=self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,\n"
        "                tp_group=next(iter(tp_groups.values())) if len(tp_groups) == 1 else None,\n"
        "            )\n")],
    "mtp-dynamic-cp-group": [
        ("megatron/core/transformer/multi_token_prediction.py",
         "            cp_group=self.cp_group,\n            packed_seq_params=packed_seq_params,\n"
         "        )\n        position_ids, _ = roll_tensor(\n",
         "            cp_group=_micro_batch_cp_group(self.cp_group, packed_seq_params),\n"
         "            packed_seq_params=packed_seq_params,\n"
         "        )\n        position_ids, _ = roll_tensor(\n"),
        ("megatron/core/transformer/multi_token_prediction.py",
         "            cp_group=self.cp_group,\n            packed_seq_params=packed_seq_params,\n"
         "        )\n",
         "            cp_group=_micro_batch_cp_group(self.cp_group, packed_seq_params),\n"
         "            packed_seq_params=packed_seq_params,\n        )\n"),
        ("megatron/core/transformer/multi_token_prediction.py",
         "def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):\n",
         '''def _micro_batch_cp_group(static_group, packed_seq_params):
    """megatron-hcp mtp-dynamic-cp-group: the micro-batch's dynamic CP group (None: no CP)."""
    if packed_seq_params is None:
        return static_group
    if packed_seq_params.cp_group is not None:
        return packed_seq_params.cp_group
    if packed_seq_params.local_cp_size == 1:
        return None
    return static_group


def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
'''),
        ("megatron/core/models/gpt/gpt_model.py",
         "                mtp_labels, _ = roll_tensor(\n                    mtp_labels,\n"
         "                    shifts=-1,\n                    dims=-1,\n"
         "                    cp_group=self.cp_group,\n",
         "                mtp_labels, _ = roll_tensor(\n                    mtp_labels,\n"
         "                    shifts=-1,\n                    dims=-1,\n"
         "                    cp_group=_micro_batch_cp_group(self.cp_group, packed_seq_params),\n"),
        ("megatron/core/models/gpt/gpt_model.py",
         "                loss_mask, num_tokens = roll_tensor(\n                    loss_mask,\n"
         "                    shifts=-1,\n                    dims=-1,\n"
         "                    cp_group=self.cp_group,\n",
         "                loss_mask, num_tokens = roll_tensor(\n                    loss_mask,\n"
         "                    shifts=-1,\n                    dims=-1,\n"
         "                    cp_group=_micro_batch_cp_group(self.cp_group, packed_seq_params),\n"),
        ("megatron/core/models/gpt/gpt_model.py",
         "    roll_tensor,\n",
         "    _micro_batch_cp_group,  # megatron-hcp mtp-dynamic-cp-group\n    roll_tensor,\n"),
    ],
    "mamba-dynamic-cp-group": [
        ("megatron/core/ssm/mamba_mixer.py",
         "        zxBCdt = self.cp.pre_conv_ssm(zxBCdt, packed_seq_params)\n",
         "        # megatron-hcp mamba-dynamic-cp-group: the micro-batch's dynamic CP group\n"
         "        static_cp = self.cp\n"
         "        self.cp = self._cp_for(packed_seq_params)\n"
         "        try:\n"
         "            return self._forward_cp(\n"
         "                zxBCdt, conv_state, ssm_state, in_inference_mode, packed_seq_params\n"
         "            )\n"
         "        finally:\n"
         "            self.cp = static_cp\n\n"
         "    def _cp_for(self, packed_seq_params):\n"
         "        \"\"\"The MambaContextParallel of the micro-batch's CP group (cached per group).\"\"\"\n"
         "        group = getattr(packed_seq_params, \"cp_group\", None)\n"
         "        local = getattr(packed_seq_params, \"local_cp_size\", None)\n"
         "        if group is None and local != 1:\n"
         "            return self.cp\n"
         "        cache = self.__dict__.setdefault(\"_dynamic_cp\", {})\n"
         "        if id(group) not in cache:\n"
         "            static = self.cp\n"
         "            cache[id(group)] = MambaContextParallel(\n"
         "                cp_group=group if group is not None else _NoCPGroup(),\n"
         "                d_inner_local_tp=static.d_inner_local_tp,\n"
         "                nheads_local_tp=static.nheads_local_tp,\n"
         "                ngroups_local_tp=static.ngroups_local_tp,\n"
         "                d_state=static.d_state,\n"
         "                conv1d_cp1=static.conv1d_cp1,\n"
         "                dt_bias_cp1=static.dt_bias_cp1,\n"
         "                A_log_cp1=static.A_log_cp1,\n"
         "                D_cp1=static.D_cp1,\n"
         "                D_has_hdim=static.D_has_hdim,\n"
         "            )\n"
         "        return cache[id(group)]\n\n"
         "    def _forward_cp(self, zxBCdt, conv_state, ssm_state, in_inference_mode,\n"
         "                    packed_seq_params):\n"
         "        zxBCdt = self.cp.pre_conv_ssm(zxBCdt, packed_seq_params)\n"),
        _append("megatron/core/ssm/mamba_mixer.py", _no_cp_group("mamba-dynamic-cp-group")),
    ],
    "moe-metrics-collection-dp": [(
        "megatron/core/transformer/moe/moe_logging.py",
        "            dp_group = getattr(pg_collection, 'dp_cp_gtp_remat', None)\n",
        "            dp_group = getattr(pg_collection, 'dp_cp_gtp_remat', None)\n"
        "            # megatron-hcp moe-metrics-collection-dp: a collection without gtp_remat\n"
        "            # groups (one rank on that axis) averages over its own dp_cp group\n"
        "            if dp_group is None:\n"
        "                dp_group = getattr(pg_collection, 'dp_cp', None)\n")],
    "cpu-yarn-rope-device": _torch_view_edit("cpu-yarn-rope-device"),
    "mla-tp-group": _mla_tp_group_edits(fused=False),
    # 0.19.2 only (the release it is written for). The fork enters the model's groups where
    # GPTModel itself asks for them (its constructor and its MTP loss): a fork has no Bridge
    # hook (bridge-model-groups) entering them around the build
    "mtp-collection-groups": [
        ("megatron/core/transformer/multi_token_prediction.py",
         "    else:\n"
         "        if parallel_state.is_pipeline_last_stage(ignore_virtual=False, "
         "vp_stage=vp_stage):\n",
         "    elif pp_rank is not None:\n"
         "        # megatron-hcp mtp-collection-groups: the pipeline rank the caller passes (the\n"
         "        # model's own, e.g. get_gpt_mtp_block_spec's pp_rank) decides the last stage\n"
         "        vp_size = config.virtual_pipeline_model_parallel_size\n"
         "        last_vp = vp_size in (None, 1) or vp_stage == vp_size - 1\n"
         "        last_pp = pp_rank == config.pipeline_model_parallel_size - 1\n"
         "        num_layers_to_build = (config.mtp_num_layers or 0) if last_pp and last_vp else 0\n"
         "    else:\n"
         "        if parallel_state.is_pipeline_last_stage(ignore_virtual=False, "
         "vp_stage=vp_stage):\n"),
        ("megatron/core/transformer/multi_token_prediction.py",
         "import warnings\n",
         "import contextlib  # megatron-hcp mtp-collection-groups\n"
         "import contextvars\n"
         "import warnings\n"),
        ("megatron/core/transformer/multi_token_prediction.py",
         "def mtp_on_this_rank(\n", _model_groups_module() + "def mtp_on_this_rank(\n"),
        ("megatron/core/models/gpt/gpt_model.py",
         "    mtp_on_this_rank,\n    process_mtp_loss,\n)\n",
         "    model_groups,  # megatron-hcp mtp-collection-groups\n"
         "    mtp_on_this_rank,\n    process_mtp_loss,\n)\n"),
        ("megatron/core/models/gpt/gpt_model.py",
         _MTP_ON_THIS_RANK,
         "        # megatron-hcp mtp-collection-groups: this model's groups in context\n"
         "        with model_groups(self.pg_collection, "
         "self.config.virtual_pipeline_model_parallel_size):\n"
         + _indented(_MTP_ON_THIS_RANK)),
        ("megatron/core/models/gpt/gpt_model.py",
         _MTP_LOSS_CALL,
         "                # megatron-hcp mtp-collection-groups: the logged MTP loss averages over\n"
         "                # this model's data-parallel group\n"
         "                with model_groups(\n"
         "                    self.pg_collection, self.config.virtual_pipeline_model_parallel_size\n"
         "                ):\n"
         + _indented(_MTP_LOSS_CALL)),
    ],
    "yarn-rope-model-cp-group": [(
        "megatron/core/models/gpt/gpt_model.py",
        "                use_cpu_initialization=self.config.use_cpu_initialization,\n"
        "            )\n"
        "        elif self.position_embedding_type == 'mrope'",
        "                use_cpu_initialization=self.config.use_cpu_initialization,\n"
        "                # megatron-hcp yarn-rope-model-cp-group: the table is cut for the model's\n"
        "                # own CP group (as plain RoPE's), not megatron's global one\n"
        "                cp_group=self.pg_collection.cp,\n"
        "            )\n"
        "        elif self.position_embedding_type == 'mrope'")],
    # before the module's first definitions (every call in it looks the name up at run time):
    # the end of layers.py is cpu-sequence-parallel's, whose diff must apply on its own
    "row-parallel-tp1-output": [(
        "megatron/core/tensor_parallel/layers.py",
        "    HAVE_TE = False\n\n_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {\n",
        """    HAVE_TE = False

# megatron-hcp row-parallel-tp1-output: over a group of one rank the input itself (upstream's
# identity autograd Function returns it as is, which autograd marks a view that must not be
# modified in place: the expert MLP adds its bias to its output in place)
_upstream_reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region


def reduce_from_tensor_model_parallel_region(input_, group=None):
    if group is not None and group.size() == 1:
        return input_
    return _upstream_reduce_from_tensor_model_parallel_region(input_, group)


_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
""")],
    "pg-collection-repr": [(
        "megatron/core/process_groups_config.py",
        "                if pg is not None:\n"
        "                    active_pgs.append(f\"{field_info.name}({pg.size()})\")\n",
        "                if isinstance(pg, (list, tuple)):  # megatron-hcp pg-collection-repr (hcp)\n"
        "                    active_pgs.append(f\"{field_info.name}({[g.size() for g in pg]})\")\n"
        "                elif pg is not None:\n"
        "                    active_pgs.append(f\"{field_info.name}({pg.size()})\")\n")],
    "moe-allgather-variable-tokens": _moe_allgather_edits(),
    "mla-dynamic-cp-group": _mla_dynamic_cp_edits(),
    "moe-router-dynamic-cp-group": _moe_router_edits("0.16.1"),
}


# Edits of a version whose upstream text differs from 0.16.1's (same change, new context).
def _rope_edits_0192() -> list:
    """attention-dynamic-cp-rope on 0.19.2: the RoPE calls read mscale from an attribute."""
    first, *_, append = EDITS["attention-dynamic-cp-rope"]
    q, inference_q, k = (
        ("                            cu_seqlens=cu_seqlens_q,\n"
         "                            mscale=self._yarn_concentration_factor,\n"
         "                            cp_group={},\n"),
        ("                            self.config,\n"
         "                            cu_seqlens_q,\n"
         "                            {},\n"
         "                            mscale=self._yarn_concentration_factor,\n"),
        ("                        cu_seqlens=cu_seqlens_kv,\n"
         "                        mscale=self._yarn_concentration_factor,\n"
         "                        cp_group={},\n"))
    path = "megatron/core/transformer/attention.py"
    return [first, *((path, t.format("self.pg_collection.cp"), t.format("rope_cp_group"))
                     for t in (q, inference_q, k)), append]


def _mtp_edits_0192() -> list:
    """mtp-dynamic-cp-group on 0.19.2: the layer's three rolls, and process_mtp_loss (shared by
    GPTModel and HybridModel) instead of GPTModel._postprocess: its rolls over the micro-batch's
    group, and its per-token weights from the token counts of that whole group."""
    path = "megatron/core/transformer/multi_token_prediction.py"
    group = "_micro_batch_cp_group(self.cp_group, packed_seq_params)"
    rolls = [(path, f"{name}, _ = roll_tensor(\n{ind}    {name},\n{ind}    shifts=-1,\n"
                    f"{ind}    dims=-1,\n{ind}    cp_group=self.cp_group,\n",
              f"{name}, _ = roll_tensor(\n{ind}    {name},\n{ind}    shifts=-1,\n"
              f"{ind}    dims=-1,\n{ind}    cp_group={group},\n")
             for name, ind in (("input_ids", "        "), ("position_ids", "        "),
                               ("padding_mask", "            "))]
    helper = EDITS["mtp-dynamic-cp-group"][2]
    loss = (path,
            "    hidden_states_list = torch.chunk(hidden_states, 1 + config.mtp_num_layers, "
            "dim=0)\n",
            "    # megatron-hcp mtp-dynamic-cp-group: roll over the micro-batch's CP group\n"
            "    cp_group = _micro_batch_cp_group(cp_group, packed_seq_params)\n"
            "    hidden_states_list = torch.chunk(hidden_states, 1 + config.mtp_num_layers, "
            "dim=0)\n")
    counts = (path, PER_TOKEN_COUNTS, CP_TOKEN_COUNTS)  # the runtime's own text (integration)
    return [*rolls, helper, loss, counts]


def _mamba_edits_0192() -> list:
    """mamba-dynamic-cp-group on 0.19.2: MambaContextParallel takes the conv1d weight, bias and
    padding instead of the module."""
    (path, old, new), append = EDITS["mamba-dynamic-cp-group"]
    new = new.replace(
        "                conv1d_cp1=static.conv1d_cp1,\n",
        "                conv1d_weight_cp1=static.conv1d_weight_cp1,\n"
        "                conv1d_bias_cp1=static.conv1d_bias_cp1,\n"
        "                conv1d_padding=static.conv1d_padding,\n")
    return [(path, old, new), append]


_HYBRID_FINAL_NORM = '''

# megatron-hcp hybrid-final-norm-without-te: without Transformer Engine the stack's final norm
# is torch's (LayerNorm / RMSNorm as configured, a zero-centred gain 1 + w under
# layernorm_zero_centered_gamma, the sequence-parallel mark TE's norm carries), not TE's
from megatron.core.extensions.transformer_engine import HAVE_TE as _TE_PRESENT  # noqa: E402

if not _TE_PRESENT:

    class _ZeroCenteredGammaNorm(torch.nn.Module):
        def __init__(self, normalization, hidden_size, eps):
            super().__init__()
            self.normalization, self.eps = normalization, eps
            self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
            self.bias = (torch.nn.Parameter(torch.zeros(hidden_size))
                         if normalization == "LayerNorm" else None)

        def forward(self, x):
            shape = (self.weight.shape[0],)
            if self.normalization == "LayerNorm":
                return torch.nn.functional.layer_norm(x, shape, self.weight + 1, self.bias,
                                                      self.eps)
            return torch.nn.functional.rms_norm(x, shape, self.weight + 1, self.eps)

    def TENorm(config, hidden_size, eps=1e-5, **_):  # noqa: N802 - the name it stands for
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.layernorm_zero_centered_gamma:
            norm = _ZeroCenteredGammaNorm(config.normalization, hidden_size, eps)
        else:
            norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
'''


VERSION_EDITS: dict[str, dict[str, list]] = {
    "0.16.1": {
        "hybrid-final-norm-without-te": [_append("megatron/core/ssm/mamba_block.py",
                                                 _HYBRID_FINAL_NORM)],
    },
    "0.19.2": {
        "hybrid-final-norm-without-te": [_append("megatron/core/models/hybrid/hybrid_block.py",
                                                 _HYBRID_FINAL_NORM)],
        "attention-dynamic-cp-rope": _rope_edits_0192(),
        "mtp-dynamic-cp-group": _mtp_edits_0192(),
        "mamba-dynamic-cp-group": _mamba_edits_0192(),
        "moe-router-dynamic-cp-group": _moe_router_edits("0.19.2"),
        "mla-tp-group": _mla_tp_group_edits(fused=True),
    },
}


def edits_for(version: str) -> dict[str, list]:
    return {**EDITS, **VERSION_EDITS.get(version, {})}


def _header(name: str, version: str) -> str:
    patch = by_name([name])[0]
    return (f"From: megatron-hcp\nSubject: [PATCH] {name}: {patch.summary}\n\n"
            + textwrap.fill(f"Upstream: {patch.upstream}", 100) + "\n\n"
            f"Patch-Name: {name}\nMegatron-Core-Versions: {', '.join(patch.versions)}\n"
            + (f"Fixed-Upstream-In: {patch.fixed_in}\n" if patch.fixed_in else "")
            + f"Runtime-Digest: {runtime_digest(patch, version)}\n")


def source_root(version: str, workdir: Path) -> Path:
    """The directory holding ``megatron/core`` of ``version``: the installed package when it is
    that version, else the release's wheel from the package index, unpacked in ``workdir``."""
    if megatron_core_version() == version:
        return megatron_package_dir().parent
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
                    "--only-binary=:all:", "--python-version", "3.12", "-d", str(workdir),
                    f"megatron-core=={version}"], check=True)
    (wheel,) = workdir.glob(f"megatron_core-{version}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(workdir / "src", [n for n in zf.namelist() if n.startswith("megatron/")])
    return workdir / "src"


def generate(version: str, root: Path) -> list[Path]:
    """Write the diffs of ``version`` against the megatron-core sources under ``root``."""
    edits = edits_for(version)
    state: dict[str, str | None] = {}
    out_dir = ROOT / "patches" / f"megatron-core-{version}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
        old.unlink()
    written = []
    for number, name in enumerate(series_for(version), start=1):
        before: dict[str, str | None] = {}
        for path, old, new in edits[name]:
            if path not in state:
                file = root / path
                state[path] = file.read_text() if file.is_file() else None
            before.setdefault(path, state[path])
            text = state[path]
            if old is NEW_FILE:
                if text is not None:
                    raise SystemExit(f"{version} {name}: {path} already exists")
                state[path] = new
            elif old == "<<END>>":
                state[path] = text.rstrip("\n") + "\n" + new
            else:
                if text is None or text.count(old) != 1:
                    raise SystemExit(f"{version} {name}: edit of {path} matches "
                                     f"{0 if text is None else text.count(old)} times")
                state[path] = text.replace(old, new)
        body = []
        for path in sorted(before):
            a = (before[path] or "").splitlines(keepends=True)
            b = (state[path] or "").splitlines(keepends=True)
            src = f"a/{path}" if before[path] is not None else "/dev/null"
            body.append(f"diff --git a/{path} b/{path}\n")
            if before[path] is None:
                body.append("new file mode 100644\n")
            body.extend(difflib.unified_diff(a, b, src, f"b/{path}", n=3))
        diff = "".join(body)
        target = out_dir / f"{number:04d}-{name}.patch"
        target.write_text(_header(name, version) + f"Diff-Digest: {diff_digest(diff)}\n---\n"
                          + diff)
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", choices=VERSIONS, action="append",
                        help="only this version (repeatable); default: every supported version")
    parser.add_argument("--source", type=Path,
                        help="directory holding megatron/core of the (single) --version")
    args = parser.parse_args()
    versions = args.version or list(VERSIONS)
    if args.source and len(versions) != 1:
        parser.error("--source needs exactly one --version")
    for version in versions:
        with tempfile.TemporaryDirectory() as tmp:
            root = args.source or source_root(version, Path(tmp))
            for path in generate(version, root):
                print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
