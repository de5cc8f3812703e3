"""What the MLA family (DeepSeek-V3, Moonlight: MLA, YaRN RoPE, shared experts, multi-token
prediction) needs of megatron-core beyond the other CPU-runtime and integration patches.

* :data:`MLA_CPU_RUNTIME_PATCHES` - ``cpu-yarn-rope-device``: YaRN's RoPE (MLA's
  ``rope_type="yarn"``) makes its frequencies on ``torch.cuda.current_device()`` in its
  constructor and moves them there for every table; under the CPU runtime that module sees the
  CPU as the device (a CPU view of ``torch``, as ``cpu-rope-device`` gives plain RoPE's module).
* :data:`MLA_DECENTRALIZED_PATCHES` - ``mtp-collection-groups``: megatron-core 0.19.2's
  multi-token prediction asks megatron's global groups which pipeline stage builds the MTP
  layers and which data-parallel group averages the logged MTP loss, although every model has
  its own process-group collection - and a run on decentralized process groups (Bridge's
  ``dist.use_decentralized_pg``) has no global groups. 0.19.2 already threads the collection's
  pipeline rank to ``get_mtp_num_layers_to_build`` (``pp_rank``), which ignores it; the patch
  honours it there, and answers the other questions from the model's collection, which is in
  context (:func:`model_groups`) while a model is built (by whoever builds it: Megatron-Bridge's
  provider through ``megatron_hcp.bridge``) and while ``GPTModel`` post-processes its output.
  Where megatron's global groups exist (the MPU path) every answer is megatron's own.
  ``mla-tp-group``: with tensor parallelism, MLA gathers its compressed q / kv over megatron's
  global TP group (no ``group`` passed; every other MLA call passes its own); the patch passes
  the module's own TP group there.

Apply with :func:`apply_mla_cpu_runtime` (a run on the CPU) and :func:`apply_mla_decentralized`
(any device; ``megatron_hcp.bridge.install()`` does). All are named patches of
:data:`megatron_hcp.patching.ALL_PATCHES` (``megatron-hcp patch list``) with their fork diffs in
``patches/``.

MTP's per-token loss weights under CP (megatron-core 0.19.2's ``process_mtp_loss`` weighs each CP
rank by its own token counts) are counted over the whole CP group by ``mtp-dynamic-cp-group``,
which wraps that function (:func:`megatron_hcp.patching.integration.with_cp_token_counts`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .cpu_runtime import CpuDeviceTorch
from .registry import Patch, Target, apply, revert

__all__ = ["MLA_CPU_RUNTIME_PATCHES", "MLA_DECENTRALIZED_PATCHES", "ModelGroups",
           "apply_mla_cpu_runtime", "apply_mla_decentralized", "model_groups",
           "revert_mla_patches"]

_ROPE = "megatron.core.models.common.embeddings"
_MTP = "megatron.core.transformer.multi_token_prediction"
_MLA = "megatron.core.transformer.multi_latent_attention"


# ---------------------------------------------------------------------------- the model's groups
class ModelGroups:
    """The process groups of the model megatron is building or running: its collection and its
    virtual-pipeline size (None: no virtual pipelining)."""

    def __init__(self, pg_collection: Any, vp_size: int | None = None):
        self.pg_collection = pg_collection
        self.vp_size = vp_size if vp_size not in (None, 1) else None


_MODEL_GROUPS: contextvars.ContextVar[ModelGroups | None] = contextvars.ContextVar(
    "megatron_hcp_model_groups", default=None)


@contextlib.contextmanager
def model_groups(pg_collection: Any, vp_size: int | None = None) -> Iterator[None]:
    """Inside: multi-token prediction reads the pipeline stage and data-parallel group of the
    model from ``pg_collection`` where megatron has no global groups (``mtp-collection-groups``).
    ``pg_collection=None`` leaves megatron's global groups in charge."""
    token = _MODEL_GROUPS.set(None if pg_collection is None
                              else ModelGroups(pg_collection, vp_size))
    try:
        yield
    finally:
        _MODEL_GROUPS.reset(token)


class _CollectionParallelState:
    """megatron's ``parallel_state`` as ``multi_token_prediction`` sees it under
    ``mtp-collection-groups``: where megatron's model-parallel groups are not initialized and a
    model's groups are in context, the pipeline-stage questions and the data-parallel group with
    CP come from that model's collection; everything else is megatron's."""

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _model(self) -> ModelGroups | None:
        groups = _MODEL_GROUPS.get()
        if groups is None or self._real.model_parallel_is_initialized():
            return None
        return groups

    def get_pipeline_model_parallel_rank(self) -> int:
        groups = self._model()
        if groups is None:
            return self._real.get_pipeline_model_parallel_rank()
        return groups.pg_collection.pp.rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        groups = self._model()
        if groups is None:
            return self._real.get_pipeline_model_parallel_world_size()
        return groups.pg_collection.pp.size()

    def get_virtual_pipeline_model_parallel_world_size(self) -> int | None:
        groups = self._model()
        if groups is None:
            return self._real.get_virtual_pipeline_model_parallel_world_size()
        return groups.vp_size

    def is_pipeline_last_stage(self, ignore_virtual: bool = True,
                               vp_stage: int | None = None) -> bool:
        groups = self._model()
        if groups is None:
            return self._real.is_pipeline_last_stage(ignore_virtual=ignore_virtual,
                                                     vp_stage=vp_stage)
        if not ignore_virtual and groups.vp_size is not None and vp_stage != groups.vp_size - 1:
            return False
        pp = groups.pg_collection.pp
        return pp.rank() == pp.size() - 1

    def get_data_parallel_group(self, with_context_parallel: bool = False, *args: Any,
                                **kwargs: Any) -> Any:
        groups = self._model()
        if groups is None or not with_context_parallel or args or kwargs:
            return self._real.get_data_parallel_group(with_context_parallel, *args, **kwargs)
        pgc = groups.pg_collection
        return getattr(pgc, "dp_cp_gtp_remat", None) or pgc.dp_cp


# ---------------------------------------------------------------------------- replacements
def _make_num_layers_to_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_mtp_num_layers_to_build(config, vp_stage=None, pp_rank=None):
        """Upstream's, but the ``pp_rank`` its callers pass (the model's own pipeline rank,
        e.g. ``get_gpt_mtp_block_spec(..., pp_rank=pg_collection.pp.rank())``) decides the last
        stage instead of megatron's global pipeline group; without it (or with a custom
        pipeline layout) upstream's answer."""
        if pp_rank is None or config.pipeline_model_parallel_layout is not None:
            return original(config, vp_stage=vp_stage, pp_rank=pp_rank)
        vp_size = config.virtual_pipeline_model_parallel_size
        last_vp = vp_size in (None, 1) or vp_stage == vp_size - 1
        last_pp = pp_rank == config.pipeline_model_parallel_size - 1
        return (config.mtp_num_layers or 0) if last_pp and last_vp else 0

    return get_mtp_num_layers_to_build


def _make_postprocess(original: Callable) -> Callable:
    @functools.wraps(original)
    def _postprocess(self, *args, **kwargs):
        """Upstream's, with this model's groups in context (:func:`model_groups`): the MTP loss
        it computes is averaged for logging over this model's data-parallel group."""
        with model_groups(getattr(self, "pg_collection", None),
                          getattr(self.config, "virtual_pipeline_model_parallel_size", None)):
            return original(self, *args, **kwargs)

    return _postprocess


_MLA_TP_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("megatron_hcp_mla_tp_group",
                                                                   default=None)


def _make_own_tp_group(original: Callable) -> Callable:
    @functools.wraps(original)
    def mapping(input_, group=None):
        """Upstream's, over the calling MLA module's TP group when no group is given (inside
        ``MLASelfAttention.get_query_key_value_tensors``; elsewhere megatron's global one)."""
        return original(input_, group if group is not None else _MLA_TP_GROUP.get())

    return mapping


def _make_qkv_with_own_tp_group(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_query_key_value_tensors(self, *args, **kwargs):
        """Upstream's, with this module's TP group for the q / kv gathers it leaves groupless."""
        token = _MLA_TP_GROUP.set(self.pg_collection.tp)
        try:
            return original(self, *args, **kwargs)
        finally:
            _MLA_TP_GROUP.reset(token)

    return get_query_key_value_tensors


# ---------------------------------------------------------------------------- patches
MLA_CPU_RUNTIME_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu-yarn-rope-device",
        summary="YaRN RoPE (MLA's rope_type='yarn') makes and keeps its frequencies on the CPU",
        upstream="megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py:76 "
        "YarnRotaryEmbedding.__init__ device = torch.cuda.current_device() unless "
        "use_cpu_initialization (MLA never passes it: multi_latent_attention.py:190-200); "
        "122,126 get_emb moves inv_freq_extra / inv_freq_inter to torch.cuda.current_device()",
        versions=("0.16.1", "0.19.2"),
        targets=(Target(f"{_ROPE}.yarn_rotary_pos_embedding", "torch", CpuDeviceTorch),),
        category="cpu-runtime",
    ),
)

MLA_DECENTRALIZED_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="mtp-collection-groups",
        summary="multi-token prediction takes the pipeline stage and the data-parallel group "
        "from the model's own process-group collection where megatron has no global groups "
        "(decentralized path)",
        upstream="megatron/core/transformer/multi_token_prediction.py:707 "
        "get_mtp_num_layers_to_build ignores the pp_rank gpt_layer_specs.py:763 passes it and "
        "reads parallel_state.is_pipeline_last_stage; 635-654 mtp_on_this_rank (called by "
        "GPTModel.__init__, gpt_model.py:160) reads the global pipeline rank; 873 "
        "process_mtp_loss (GPTModel._postprocess, gpt_model.py:701) averages the logged loss "
        "over parallel_state.get_data_parallel_group(with_context_parallel=True): each an "
        "AssertionError without megatron's global groups",
        versions=("0.19.2",),
        targets=(
            Target(_MTP, "get_mtp_num_layers_to_build", _make_num_layers_to_build,
                   params=("config", "vp_stage", "pp_rank"), also_bound_under="megatron.core"),
            Target(_MTP, "parallel_state", _CollectionParallelState),
            Target("megatron.core.models.gpt.gpt_model", "GPTModel._postprocess",
                   _make_postprocess, params=("self", "hidden_states")),
        ),
    ),
    Patch(
        name="mla-tp-group",
        summary="MLA gathers its compressed q / kv over its own TP group, not megatron's global "
        "one (tensor parallelism on the decentralized path)",
        upstream="megatron/core/transformer/multi_latent_attention.py:652,654 "
        "(MLASelfAttention._qkv_down_projection), 739,746 (get_query_key_value_tensors) and "
        "1366,1368 (FusedMLASelfAttention._qkv_down_projection, called there) "
        "gather_from_tensor_model_parallel_region / scatter_to_sequence_parallel_region "
        "without group: megatron's global TP group, None without it (AttributeError "
        "'NoneType' object has no attribute 'size'); 0.16.1: 594,596,607,614",
        versions=("0.16.1", "0.19.2"),
        targets=(
            Target(_MLA, "gather_from_tensor_model_parallel_region", _make_own_tp_group,
                   params=("input_", "group")),
            Target(_MLA, "scatter_to_sequence_parallel_region", _make_own_tp_group,
                   params=("input_", "group")),
            Target(_MLA, "MLASelfAttention.get_query_key_value_tensors",
                   _make_qkv_with_own_tp_group, params=("self", "hidden_states")),
        ),
    ),
)


def apply_mla_cpu_runtime() -> list[str]:
    """Apply :data:`MLA_CPU_RUNTIME_PATCHES` for a run on the CPU; return the names applied."""
    return apply(MLA_CPU_RUNTIME_PATCHES)


def apply_mla_decentralized() -> list[str]:
    """Apply the :data:`MLA_DECENTRALIZED_PATCHES` written for the installed megatron-core
    (``mtp-collection-groups`` is 0.19.2's only); return the names applied."""
    return apply(p for p in MLA_DECENTRALIZED_PATCHES if p.supports())


def revert_mla_patches() -> list[str]:
    """Revert every patch of this module that is applied; return the names."""
    return revert(MLA_CPU_RUNTIME_PATCHES + MLA_DECENTRALIZED_PATCHES)
