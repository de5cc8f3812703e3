"""Megatron-Bridge hook: hierarchical CP on Bridge's decentralized process-group path.

:func:`install` applies :data:`BRIDGE_PATCHES`: four named, version-gated, reversible patches of
the patch registry (``megatron-hcp patch list`` shows them; :func:`uninstall` reverts them):

* ``training.initialize._create_pg_collection``: a config with
  ``hierarchical_context_parallel_sizes`` gets :func:`~.collection.create_pg_collection`
  (validated through :class:`~megatron_hcp.config.CPConfig`, ``hcp`` filled) instead of
  Bridge's ``NotImplementedError`` (0.4+) or its flat groups with ``hcp=None`` (0.3); every
  other config goes to Bridge's own function unchanged;
* ``models.gpt_provider.GPTModelProvider.provide``: with the TE full-layer spec Bridge hands
  every TE attention module the flat CP group (and TE's default comm type ``p2p``); afterwards
  the hierarchical groups of the provider's collection are given back;
* ``training.eval_context_parallel_rebinding.install_pg_collection`` (Bridge 0.5+): the same
  after the train/eval rebinding of ``eval_cp_context``;
* ``training.model_load_save.load_megatron_model``: Bridge forces CP=1 and clears
  ``hierarchical_context_parallel_sizes``. Decision: with CP=1 after ``mp_overrides`` the
  clearing is right (the sizes are logged as unused); with CP>1 and a2a+p2p the checkpoint's
  sizes are restored when their product equals the new CP size (logged), else an error names
  the fix (``mp_overrides={"hierarchical_context_parallel_sizes": [a2a, p2p]}``). The result is
  validated by ``CPConfig`` either way: the user's HCP settings are never lost silently.

Bridge modules that imported one of these functions by value (e.g. the diffusion pipelines'
``load_megatron_model``) are rebound too when already imported. Written for every Bridge release
0.4.0-0.6.2 (signatures read from each release's wheel; 0.6.2 runs in CI on the Python 3.12
leg); :func:`install` also checks the wrapped signatures first and refuses, changing nothing,
when they differ.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ..attention.te import rebind_te_cp_groups
from ..config import CPConfig, CPConfigError, Violation
from ..group_release import release_at_exit
from ..parallel_state.collection import create_pg_collection_and_grid, grid_views_available
from ..patching.mla import MLA_DECENTRALIZED_PATCHES
from ..patching.registry import Patch, PatchError, Target, apply, is_applied, revert
from .config import cp_config_from_bridge, window_override
from .dynamic_cp import cp_config_of, dynamic_cp_targets
from .family_patches import BRIDGE_FAMILY_PATCHES
from .mtp import BRIDGE_MTP_PATCHES

__all__ = [
    "BRIDGE_LOOP_PATCHES",
    "BRIDGE_PATCHES",
    "BRIDGE_VERSIONS",
    "BridgeHookError",
    "BridgeNotInstalledError",
    "cp_config_from_model_config",
    "cp_config_from_overrides",
    "install",
    "installed",
    "uninstall",
]

logger = logging.getLogger("megatron_hcp")

_PKG = "megatron.bridge"
# Bridge releases whose wrapped functions have the signatures below (read from each wheel)
BRIDGE_VERSIONS = ("0.4.0", "0.4.1", "0.4.2", "0.5.0", "0.5.1", "0.6.0", "0.6.2")
_WITH_EVAL_REBINDING = ("0.5.0", "0.5.1", "0.6.0", "0.6.2")


class BridgeNotInstalledError(ImportError):
    """Megatron-Bridge is not importable."""


class BridgeHookError(PatchError):
    """The installed Bridge differs from the code the hook was written for."""


# ---------------------------------------------------------------------------- configs
def _uses_a2a_p2p(comm: Any) -> bool:
    return comm == "a2a+p2p" or (isinstance(comm, (list, tuple)) and "a2a+p2p" in comm)


def cp_config_from_model_config(model_config: Any, world_size: int | None = None) -> CPConfig:
    """The CP-relevant fields of a Bridge/megatron model config on ``world_size`` ranks
    (default: one data-parallel replica), read strictly
    (:func:`~megatron_hcp.bridge.config.cp_config_from_bridge`): every bad field is one
    violation of the :class:`CPConfigError` (field, value, rule, fix), raised before anything
    is built. The attention backend is left to the layer spec (no TE rules here)."""
    return cp_config_from_bridge(model_config, world_size, te_version=None)


def cp_config_from_overrides(overrides: Sequence[str], base: CPConfig | None = None,
                             ) -> tuple[CPConfig, dict[str, Any]]:
    """Bridge-style ``section.key=value`` overrides -> validated CPConfig and ``dist`` settings.

    ``model.<field>`` entries that are CPConfig fields are applied onto ``base`` (other model
    fields are Bridge's business and ignored here); ``dist.*`` entries are returned as a dict.
    Raises :class:`CPConfigError` (parameter, value, rule, fix) when the result is invalid.
    """
    import dataclasses

    from ..config import parse_value

    fields = set(CPConfig.field_names())
    model_raw: dict[str, str] = {}
    dist_settings: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, _, name = key.strip().lstrip("+").partition(".")
        if not sep or not name:
            raise CPConfigError([Violation(item, None, "overrides are section.key=value",
                                           "write e.g. model.context_parallel_size=4")])
        if section == "model" and name in fields:
            model_raw[name] = window_override(raw) if name == "window_size" else raw
        elif section == "dist":
            dist_settings[name] = parse_value(raw)
    given = CPConfig.from_pairs([f"{k}={v}" for k, v in model_raw.items()])  # typed values
    config = dataclasses.replace(base or CPConfig(), **{k: getattr(given, k) for k in model_raw})
    config.validate()
    return config, dist_settings


# ---------------------------------------------------------------------------- wrappers
def _make_create_pg_collection(original: Callable) -> Callable:
    accepted = set(inspect.signature(original).parameters)
    module = importlib.import_module(original.__module__)

    @functools.wraps(original)
    def _create_pg_collection(model_config, num_distributed_optimizer_instances,
                              get_embedding_ranks=None, get_position_embedding_ranks=None,
                              world_size=None, rank_offset=None, save_grid=False):
        prepared = cp_config_of(model_config)  # set by bridge-cp-setup in Bridge's loop
        dynamic = prepared is not None and prepared.dynamic
        if getattr(model_config, "hierarchical_context_parallel_sizes", None) is None and (
                not dynamic):
            extra = {k: v for k, v in (("world_size", world_size), ("rank_offset", rank_offset),
                                       ("save_grid", save_grid)) if k in accepted}
            return original(model_config, num_distributed_optimizer_instances,
                            get_embedding_ranks=get_embedding_ranks,
                            get_position_embedding_ranks=get_position_embedding_ranks, **extra)
        set_default = getattr(module, "_set_moe_expert_tensor_parallel_default", None)
        if set_default is not None:
            set_default(model_config)
        world = world_size if world_size is not None else dist.get_world_size()
        config = (prepared if prepared is not None and prepared.world_size == world
                  else cp_config_from_model_config(model_config, world))
        problems = []
        instances = num_distributed_optimizer_instances
        if not isinstance(instances, int) or isinstance(instances, bool) or instances != 1:
            problems.append(Violation(
                "num_distributed_optimizer_instances", instances,
                "must be the integer 1: hierarchical CP on the decentralized path builds one "
                "distributed-optimizer instance", "set ddp.num_distributed_optimizer_instances=1"))
        if save_grid and not grid_views_available():
            problems.append(Violation(
                "save_grid", save_grid, "with hierarchical CP this megatron-core (no "
                "HyperCommGrid.register_view, added in 0.19) needs a second grid for the HCP "
                "levels; there is no single grid to save",
                "call without save_grid, or use megatron-core >= 0.19"))
        if problems:
            raise CPConfigError(problems)
        collection, grid = create_pg_collection_and_grid(
            config,
            expert_model_parallel_size=int(
                getattr(model_config, "expert_model_parallel_size", 1) or 1),
            expert_tensor_parallel_size=getattr(model_config, "expert_tensor_parallel_size",
                                                None),
            world_size=world, rank_offset=rank_offset or 0,
            get_embedding_ranks=get_embedding_ranks,
            get_position_embedding_ranks=get_position_embedding_ranks,
        )
        if save_grid:  # as Bridge does: the grid goes on the config (its "hcp" view included)
            model_config.grid = grid
        return collection

    return _create_pg_collection


def _rebind_all(model: Any, pg_collection: Any, cp_size: int, comm_of: Callable) -> None:
    """Hand every TE attention module of ``model`` its hierarchical CP groups."""
    for chunk in model if isinstance(model, list) else [model]:
        for module in chunk.modules():
            if module is chunk or not hasattr(module, "set_context_parallel_group"):
                continue
            comm = comm_of(module)
            if _uses_a2a_p2p(comm):
                rebind_te_cp_groups(module, pg_collection, cp_size, comm)


def _layer_comm(comm: Any, module: Any) -> Any:
    if isinstance(comm, (list, tuple)):
        return comm[int(getattr(module, "layer_number", 1)) - 1]
    return comm


def _make_provide(original: Callable) -> Callable:
    @functools.wraps(original)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        model = original(self, pre_process, post_process, vp_stage)
        pgc = getattr(self, "_pg_collection", None)
        if pgc is not None and getattr(pgc, "hcp", None) and _uses_a2a_p2p(self.cp_comm_type):
            _rebind_all(model, pgc, int(self.context_parallel_size),
                        lambda m: _layer_comm(self.cp_comm_type, m))
        return model

    return provide


def _make_install_pg_collection(original: Callable) -> Callable:
    @functools.wraps(original)
    def install_pg_collection(model, target):
        original(model, target)
        if getattr(target, "hcp", None):
            _rebind_all(model, target, target.cp.size(),
                        lambda m: getattr(m, "cp_comm_type", None))

    return install_pg_collection


def _decide_hcp(model_cfg: Any, saved_sizes: Any, saved_comm: Any) -> None:
    """What becomes of the checkpoint's HCP settings after Bridge's CP=1 reset (module doc)."""
    cp = int(getattr(model_cfg, "context_parallel_size", 1) or 1)
    comm = getattr(model_cfg, "cp_comm_type", None)
    if cp == 1:
        if saved_sizes is not None:
            logger.info("load_megatron_model runs with context_parallel_size=1: the "
                        "checkpoint's hierarchical_context_parallel_sizes=%s (cp_comm_type=%s) "
                        "are not used for this load (weights do not depend on CP)",
                        list(saved_sizes), saved_comm)
        return
    if _uses_a2a_p2p(comm) and model_cfg.hierarchical_context_parallel_sizes is None:
        if saved_sizes is not None and math.prod(saved_sizes) == cp:
            model_cfg.hierarchical_context_parallel_sizes = list(saved_sizes)
            logger.warning("load_megatron_model: restored the checkpoint's "
                           "hierarchical_context_parallel_sizes=%s (Bridge clears them; "
                           "context_parallel_size=%d from mp_overrides)", list(saved_sizes), cp)
        else:
            raise CPConfigError([Violation(
                "hierarchical_context_parallel_sizes", None,
                f"cp_comm_type='a2a+p2p' with context_parallel_size={cp} needs the level "
                f"sizes; Bridge's load_megatron_model clears them (the checkpoint had "
                f"{saved_sizes})",
                "pass mp_overrides={'hierarchical_context_parallel_sizes': [a2a, p2p]} with "
                f"a2a * p2p == {cp}")])
    cp_config_from_model_config(model_cfg).validate()


def _make_load_megatron_model(original: Callable) -> Callable:
    module = importlib.import_module(original.__module__)

    @functools.wraps(original)
    def load_megatron_model(checkpoint_path, model_type=None, return_state_dict=False,
                            use_cpu_init=False, skip_temp_dist_context=None, mp_overrides=None):
        saved: dict[str, Any] = {}
        load_config, build = module.load_model_config, module.build_and_load_model

        def load_model_config(*args, **kwargs):
            cfg, mlm_args = load_config(*args, **kwargs)
            saved["sizes"] = getattr(cfg, "hierarchical_context_parallel_sizes", None)
            saved["comm"] = getattr(cfg, "cp_comm_type", None)
            return cfg, mlm_args

        def build_and_load_model(path, model_cfg, *args, **kwargs):
            _decide_hcp(model_cfg, saved.get("sizes"), saved.get("comm"))
            return build(path, model_cfg, *args, **kwargs)

        module.load_model_config, module.build_and_load_model = (load_model_config,
                                                                 build_and_load_model)
        try:
            return original(checkpoint_path, model_type, return_state_dict, use_cpu_init,
                            skip_temp_dist_context, mp_overrides)
        finally:
            module.load_model_config, module.build_and_load_model = load_config, build

    return load_megatron_model


def _target(module: str, qualname: str, make: Callable, params: tuple[str, ...],
            **kwargs: Any) -> Target:
    return Target(f"{_PKG}.{module}", qualname, make, params=params, also_bound_under=_PKG,
                  **kwargs)


def _patch(name: str, summary: str, upstream: str, target: Target) -> Patch:
    return Patch(name=name, summary=summary, upstream=upstream, versions=BRIDGE_VERSIONS,
                 targets=(target,), category="bridge", package="megatron-bridge")


BRIDGE_PATCHES: tuple[Patch, ...] = (
    _patch("bridge-hcp-pg-collection",
           "Bridge's _create_pg_collection builds hcp for hierarchical CP (validated by CPConfig) "
           "instead of raising NotImplementedError; other configs reach Bridge unchanged",
           "megatron/bridge/training/initialize.py _create_pg_collection (NotImplementedError "
           "for hierarchical_context_parallel_sizes)",
           _target("training.initialize", "_create_pg_collection", _make_create_pg_collection,
                   ("model_config", "num_distributed_optimizer_instances",
                    "get_embedding_ranks", "get_position_embedding_ranks"))),
    _patch("bridge-provide-te-hcp",
           "GPTModelProvider.provide gives TE attention the hierarchical CP groups back after "
           "Bridge hands it the flat group",
           "megatron/bridge/models/gpt_provider.py GPTModelProvider.provide "
           "(set_context_parallel_group with the flat CP group)",
           _target("models.gpt_provider", "GPTModelProvider.provide", _make_provide,
                   ("self", "pre_process", "post_process", "vp_stage"))),
    _patch("bridge-load-keeps-hcp",
           "load_megatron_model keeps, restores or asks for hierarchical_context_parallel_sizes "
           "instead of clearing them silently",
           "megatron/bridge/training/model_load_save.py load_megatron_model (forces CP=1, "
           "clears hierarchical_context_parallel_sizes)",
           _target("training.model_load_save", "load_megatron_model", _make_load_megatron_model,
                   ("checkpoint_path", "model_type", "return_state_dict", "use_cpu_init",
                    "skip_temp_dist_context", "mp_overrides"))),
    _patch("bridge-eval-rebinding-te-hcp",
           "install_pg_collection (train/eval CP rebinding) gives TE attention the hierarchical "
           "CP groups back",
           "megatron/bridge/training/eval_context_parallel_rebinding.py install_pg_collection "
           "(set_context_parallel_group with the flat CP group; Bridge 0.5+)",
           _target("training.eval_context_parallel_rebinding", "install_pg_collection",
                   _make_install_pg_collection, ("model", "target"),
                   versions=_WITH_EVAL_REBINDING)),
)

_LOOP_VERSIONS = ("0.6.2",)  # Bridge releases whose training loop these were run against
_LOOP = dynamic_cp_targets()


def _loop_patch(name: str, summary: str, upstream: str) -> Patch:
    return Patch(name=name, summary=summary, upstream=upstream, versions=_LOOP_VERSIONS,
                 targets=_LOOP[name], category="bridge", package="megatron-bridge")


# Bridge's training loop (pretrain / finetune) with megatron-hcp's CP: validation before any
# process group, the MPU path's groups checked and logged, dynamic CP (megatron_hcp.bridge.
# dynamic_cp); the MTP block of a provider on megatron-hcp's spec without TE (.mtp)
BRIDGE_LOOP_PATCHES: tuple[Patch, ...] = (
    _loop_patch("bridge-cp-setup",
                "pretrain()/finetune() read the CP fields strictly at entry and setup validates "
                "the config as a CP setup (CPConfig, every rank, before any process group), "
                "taking dynamic CP over from megatron-core's own",
                "megatron/bridge/training/pretrain.py:74 runtime_config_update (config.py:1024 "
                "divides by the CP size as given: a string size is a TypeError); "
                "training/setup.py setup (initialize_megatron with the config as given)"),
    _loop_patch("bridge-mpu-cp-groups",
                "on the MPU path megatron's groups are checked against the CP layout and "
                "logged (HIERARCHICAL_CONTEXT_PARALLEL_GROUPS), dynamic CP groups created",
                "megatron/bridge/training/initialize.py:786-835 _initialize_distributed "
                "(megatron's initialize_model_parallel, nothing logged or checked)"),
    _loop_patch("bridge-dynamic-cp-schedule",
                "each step schedules its global batch over dynamic CP groups and runs the "
                "plan's micro-batches through megatron's schedule",
                "megatron/bridge/training/train.py:311 and eval.py:184 "
                "get_forward_backward_func (num_microbatches fixed, data as loaded)"),
    _loop_patch("bridge-dynamic-cp-batch",
                "the forward step takes a dynamic-CP micro-batch as it is (this rank's tokens, "
                "its CP group in PackedSeqParams)",
                "megatron/bridge/training/gpt_step.py:305-336 get_batch (cuts packed batches "
                "for the static CP group), packed_seq_utils.get_packed_seq_params"),
) + BRIDGE_MTP_PATCHES + BRIDGE_FAMILY_PATCHES


# ---------------------------------------------------------------------------- install
def _has_training_loop() -> bool:
    """Bridge ships its training loop (``training.train``); a Bridge without one has no
    ``pretrain`` to patch (e.g. the tests' stand-in of the four hooked functions)."""
    import importlib.util

    try:
        return importlib.util.find_spec(f"{_PKG}.training.train") is not None
    except (ImportError, ValueError):
        return False


def _hook_patches() -> tuple[Patch, ...]:
    """Everything :func:`install` applies to Bridge: the group hooks, and the training-loop
    patches on the Bridge releases they were written for (refused, like the hooks, on another
    release with a training loop)."""
    return BRIDGE_PATCHES + (BRIDGE_LOOP_PATCHES if _has_training_loop() else ())


def _core_patches() -> list[Patch]:
    """megatron-core patches Bridge's loop needs for megatron-hcp's CP: dynamic CP (RoPE, MTP
    and pipeline shapes per micro-batch), the decentralized path's TP-group fixes and MTP's
    groups (``mtp-collection-groups``, megatron-core 0.19.2), the local spec's expert biases
    (``row-parallel-tp1-output``), and Transformer Engine's attention honouring hcp and dynamic
    groups where TE imports."""
    from ..patching import DECENTRALIZED_PATCHES, DYNAMIC_CP_PATCHES, LOCAL_SPEC_PATCHES, by_name

    patches = by_name([*DYNAMIC_CP_PATCHES, *DECENTRALIZED_PATCHES, *LOCAL_SPEC_PATCHES,
                       "destroy-forgets-stale-groups", "rope-cp-partition-mode",
                       "moe-allgather-variable-tokens", "mla-dynamic-cp-group",
                       "moe-router-dynamic-cp-group"])
    mtp = [p for p in MLA_DECENTRALIZED_PATCHES if p.supports()]  # megatron-core 0.19.2's MTP
    return [p for p in patches + by_name(["te-attention-hcp", "mamba-dynamic-cp-group"]) + mtp
            if not p.missing_requirement()]


def installed() -> bool:
    """True when :func:`install` is in effect."""
    try:
        return all(is_applied(p) for p in _hook_patches())
    except Exception:  # noqa: BLE001 - Bridge missing or not importable: not installed
        return False


def install() -> None:
    """Hook megatron_hcp into Megatron-Bridge (idempotent; :func:`uninstall` reverts)."""
    try:
        importlib.import_module(_PKG)
    except ImportError as err:
        raise BridgeNotInstalledError(
            f"Megatron-Bridge is not installed ({err}); megatron_hcp.bridge.install() hooks "
            "into it. Install megatron-bridge, or call megatron_hcp.bridge.create_pg_collection "
            "directly (it needs no Bridge)") from err
    try:
        done = apply(_hook_patches())
    except PatchError as err:
        raise BridgeHookError(
            "the installed Megatron-Bridge differs from the code megatron_hcp's hook was "
            f"written for (releases {', '.join(BRIDGE_VERSIONS)}); nothing was changed:\n  "
            f"{err}") from err
    done += apply(_core_patches())
    release_at_exit()  # also when Bridge's own functions build the groups (no CP, no HCP)
    if done:
        logger.info("megatron_hcp: Megatron-Bridge hook installed (%s)", ", ".join(done))


def uninstall() -> None:
    """Undo :func:`install` (no-op when not installed)."""
    if sys.modules.get(_PKG) is None:  # never imported (or made unimportable): nothing hooked
        return
    revert(_hook_patches())
