"""Bridge's multi-token-prediction block on megatron-hcp's spec where Transformer Engine is absent.

Bridge 0.6.2's ``GPTModelProvider.provide`` builds the MTP block with
``gpt_provider.mtp_block_spec``, which asks megatron for TE's block always
(``get_gpt_mtp_block_spec(..., use_transformer_engine=True)``, and the same for its last-stage
decoder-layer fallback): without TE megatron has no ``TESpecProvider`` (None) and the build fails
with ``TypeError: 'NoneType' object is not callable`` - with or without megatron-hcp, so no MTP
model (DeepSeek-V3, Moonlight, GLM, ...) builds without TE through Bridge.

:data:`BRIDGE_MTP_PATCHES` (``install()`` applies them with the training-loop patches):

* ``bridge-mtp-block-spec-local`` answers that call with
  :func:`megatron_hcp.bridge.spec.mtp_block_spec` - megatron's MTP block on the local backend over
  megatron-hcp's layers (the provider's own layer, its CP attention, SP norms) - when the
  provider's ``transformer_layer_spec`` is megatron-hcp's (:func:`~.spec.layer_spec` assigned, or
  :func:`~.spec.use_cp_attention`) and TE does not import. Every other provider, and every
  provider where TE imports, gets Bridge's own function unchanged.
* ``bridge-model-groups``: Bridge's ``GPTModel`` build runs with the provider's process-group
  collection in context (:func:`megatron_hcp.patching.mla.model_groups`), where megatron-core's
  multi-token prediction reads its pipeline stage on the decentralized path (megatron-hcp's
  ``mtp-collection-groups``; megatron has no global groups there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..attention.te import have_te
from ..patching.mla import model_groups
from ..patching.registry import Patch, Target
from . import spec as hcp_spec

__all__ = ["BRIDGE_MTP_PATCHES", "hcp_spec_backend"]

_PKG = "megatron.bridge"
# Bridge releases whose gpt_provider.mtp_block_spec was read and run against
VERSIONS = ("0.6.2",)


def hcp_spec_backend(provider: Any) -> str | None:
    """The backend of megatron-hcp's spec (``auto``, ``te``, ``reference``) when ``provider``'s
    ``transformer_layer_spec`` is it - :func:`~.spec.layer_spec` itself, or the partial of it
    :func:`~.spec.use_cp_attention` sets - else None."""
    spec = getattr(provider, "transformer_layer_spec", None)
    backend = None
    while isinstance(spec, functools.partial):
        backend = backend or spec.keywords.get("backend")
        spec = spec.func
    return (backend or "auto") if spec is hcp_spec.layer_spec else None


def _make_mtp_block_spec(original: Callable) -> Callable:
    @functools.wraps(original)
    def mtp_block_spec(config, vp_stage=None):
        """Bridge's, but a provider on megatron-hcp's spec without TE gets megatron-hcp's MTP
        block (local backend) instead of TE's, which cannot be built there."""
        backend = hcp_spec_backend(config)
        if backend is None or have_te():
            return original(config, vp_stage=vp_stage)
        return hcp_spec.mtp_block_spec(config, vp_stage, backend=backend)

    return mtp_block_spec


def _make_model_build(original: Callable) -> Callable:
    def build_gpt_model(config, *args, pg_collection=None, **kwargs):
        """megatron's ``GPTModel(config, ...)`` as Bridge's ``provide`` builds it, inside
        :func:`~megatron_hcp.patching.mla.model_groups` of the collection Bridge passes."""
        vp_size = getattr(config, "virtual_pipeline_model_parallel_size", None)
        with model_groups(pg_collection, vp_size):
            return original(config, *args, pg_collection=pg_collection, **kwargs)

    return build_gpt_model


BRIDGE_MTP_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-mtp-block-spec-local",
        summary="a provider on megatron-hcp's spec builds its multi-token-prediction block "
        "without Transformer Engine (megatron-hcp's mtp_block_spec: local backend, the CP "
        "attention) instead of TE's",
        upstream="megatron/bridge/models/gpt_provider.py:343-379 mtp_block_spec (called by "
        "GPTModelProvider.provide, 312) asks get_gpt_mtp_block_spec for use_transformer_engine="
        "True always (376; the decoder-layer fallback at 369-374 too): without TE megatron's "
        "TESpecProvider is None (gpt_layer_specs.py:738, TypeError)",
        versions=VERSIONS,
        targets=(Target(f"{_PKG}.models.gpt_provider", "mtp_block_spec", _make_mtp_block_spec,
                        params=("config", "vp_stage"), also_bound_under=_PKG),),
        category="bridge", package="megatron-bridge",
    ),
    Patch(
        name="bridge-model-groups",
        summary="GPTModelProvider.provide builds megatron's GPTModel with the provider's "
        "process-group collection in context (multi-token prediction reads its pipeline "
        "stage there on the decentralized path: megatron-hcp's mtp-collection-groups)",
        upstream="megatron/bridge/models/gpt_provider.py:293-313 MCoreGPTModel(self, ..., "
        "pg_collection=self._pg_collection): megatron-core 0.19.2's GPTModel.__init__ asks "
        "mtp_on_this_rank (multi_token_prediction.py:635) for the global pipeline rank, which "
        "the decentralized path never sets",
        versions=VERSIONS,
        # any callable in MCoreGPTModel's place takes the wrapper (config, *args, **kwargs)
        targets=(Target(f"{_PKG}.models.gpt_provider", "MCoreGPTModel", _make_model_build),),
        category="bridge", package="megatron-bridge",
    ),
)
