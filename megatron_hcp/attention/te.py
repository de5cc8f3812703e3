"""Transformer Engine attention with CP groups from the project's one decision.

megatron's ``TEDotProductAttention`` reads megatron's global hierarchical groups for a2a+p2p
(ignoring ``pg_collection.hcp``), creates a CUDA stream eagerly and never restores its groups
after a dynamic-CP micro-batch. :func:`make_te_init` / :func:`make_te_forward` are the
replacements the ``te-attention-hcp`` patch installs on that class (the one TE path; there is no
subclass): groups from :func:`~megatron_hcp.attention.groups.resolve_cp_groups`
(``pg_collection.hcp`` for a2a+p2p, the per-micro-batch dynamic group), a lazily created
``cp_stream``, and the constructor's groups restored after every forward.

Written against TE's and megatron's APIs; **not run on Transformer Engine here** (no GPU). The
wrappers are tested against a recording stand-in of TE's base class.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from .groups import CPGroups, mpu_pg_collection, resolve_cp_groups, te_cp_kwargs, uses_dynamic_cp
from .partition import partition_mode

__all__ = ["TEUnavailableError", "carries_te_cp_groups", "have_te", "installed_te_version",
           "make_te_forward", "make_te_init", "rebind_te_cp_groups", "require_te_feature",
           "te_attention_class", "te_unavailable_reason"]

logger = logging.getLogger("megatron_hcp")


class TEUnavailableError(RuntimeError):
    """``backend="te"`` was asked for but Transformer Engine cannot be used (says why)."""


def te_unavailable_reason() -> str | None:
    """Why Transformer Engine cannot be used here, or None when it can.

    A broken install is told apart from a missing one: megatron-core swallows TE's import error
    (``HAVE_TE=False``), so it is reproduced here to be named.
    """
    import importlib.util
    import sys

    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception as err:  # noqa: BLE001 - a broken TE raises anything (OSError, ...)
        return f"importing megatron's TE extension failed: {type(err).__name__}: {err}"
    if getattr(te_ext, "HAVE_TE", False):
        return None
    if _te_stand_in() or ("transformer_engine" not in sys.modules and (
            importlib.util.find_spec("transformer_engine") is None)):
        return "Transformer Engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the reason is the result
        return (f"transformer_engine is installed but does not import: "
                f"{type(err).__name__}: {err}")
    return "megatron-core's TE extension reports HAVE_TE=False"


# set on the import-only stand-ins megatron-hcp puts in place of packages Megatron-Bridge
# imports but this machine cannot run (megatron_hcp.bridge.import_shims)
IMPORT_SHIM_MARK = "__megatron_hcp_import_shim__"


def _te_stand_in() -> bool:
    """True when ``transformer_engine`` is megatron-hcp's import-only stand-in (for Megatron-
    Bridge's imports), not an installed Transformer Engine."""
    import sys

    return bool(getattr(sys.modules.get("transformer_engine"), IMPORT_SHIM_MARK, False))


def have_te() -> bool:
    """True when Transformer Engine and megatron's TE extension import. A TE that is installed
    but broken is logged with its reason (callers then fall back to the reference backend;
    ``backend="te"`` raises it)."""
    reason = te_unavailable_reason()
    if reason is not None and reason != "Transformer Engine is not installed":
        logger.warning("Transformer Engine is unusable (%s); the reference CP attention "
                       "backend is used instead", reason)
    return reason is None


def installed_te_version() -> str | None:
    """The installed Transformer Engine's version (``transformer_engine.__version__`` when it is
    imported, else the distribution's metadata), or None."""
    import importlib.metadata
    import sys

    if _te_stand_in():
        return None
    te = sys.modules.get("transformer_engine")
    version = getattr(te, "__version__", None)
    if isinstance(version, str):
        return version
    for dist_name in ("transformer-engine", "transformer_engine"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_te_feature(groups: CPGroups, packed_seq_params: Any, te_version: str | None,
                       config: Any = None) -> None:
    """Refuse, before TE is called, a CP call the installed TE asserts on or would get wrong.

    The contiguous layout (``cp_partition_mode``, from ``packed_seq_params`` or ``config``): TE
    cuts every sequence zigzag, so it would attend over the wrong tokens without a word.
    a2a+p2p with packed THD input: TE up to 2.18 refuses it inside its forward (see
    :data:`~megatron_hcp.config.MIN_TE_VERSION_A2A_P2P_THD`); dynamic hierarchical CP always
    hits it. No CP, flat groups and bshd/sbhd input pass.
    """
    from ..config import MIN_TE_VERSION_A2A_P2P_THD, version_tuple

    if groups.enabled and partition_mode(config, packed_seq_params) != "zigzag":
        raise TEUnavailableError(
            "cp_partition_mode='contiguous' with Transformer Engine's CP attention: TE cuts "
            "every sequence zigzag (chunks r and 2cp-1-r) and has no per-sequence contiguous "
            "layout; use the reference backend (cp_attention_backend=reference), or "
            "cp_partition_mode='zigzag'")
    if not groups.enabled or not isinstance(groups.group, list):
        return
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        return
    if te_version is not None and version_tuple(te_version) >= MIN_TE_VERSION_A2A_P2P_THD:
        return
    need = ".".join(map(str, MIN_TE_VERSION_A2A_P2P_THD))
    raise TEUnavailableError(
        f"cp_comm_type=a2a+p2p with packed THD input (qkv_format='thd'"
        f"{', a dynamic-CP micro-batch' if groups.dynamic else ''}) needs Transformer Engine "
        f">= {need}; installed: {te_version or 'unknown'}. Upgrade transformer-engine, or use "
        "the reference backend, or cp_comm_type=a2a / p2p for this model")


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
            pg_collection = mpu_pg_collection()
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
        if not uses_dynamic_cp(packed_seq_params):
            require_te_feature(self._cp_resolution[2], packed_seq_params,
                               installed_te_version(), self.config)
            return original_forward(self, query, key, value, attention_mask, attn_mask_type,
                                    attention_bias=attention_bias,
                                    packed_seq_params=packed_seq_params, **kwargs)
        pg_collection, comm_type, static = self._cp_resolution
        groups = resolve_cp_groups(self.config.context_parallel_size, comm_type, pg_collection,
                                   packed_seq_params)
        require_te_feature(groups, packed_seq_params, installed_te_version(), self.config)
        _apply_te_groups(self, groups)
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


# the te-attention-hcp patch's fork-style diff marks every edit in megatron's source with this text
# (patches/megatron-core-*/NNNN-te-attention-hcp.patch)
FORK_DIFF_MARKER = "megatron-hcp te-attention-hcp"


def _made_by(factory: Any, function: Any) -> bool:
    """True when ``function`` is one that ``factory`` returns (its code is the factory's inner
    function's code)."""
    code = getattr(function, "__code__", None)
    return code is not None and code in factory.__code__.co_consts


def carries_te_cp_groups(cls: Any) -> bool:
    """True when megatron's TE attention class ``cls`` takes its CP groups from
    :func:`resolve_cp_groups`: the ``te-attention-hcp`` patch is applied at run time (its
    ``__init__`` and ``forward`` are :func:`make_te_init` / :func:`make_te_forward`'s wrappers),
    or the patch's fork-style diff is applied to megatron's source (the file defining ``cls``
    carries the diff's marker). Reads ``cls`` only, so the patch layer above need not be asked.
    """
    import inspect

    if _made_by(make_te_init, inspect.getattr_static(cls, "__init__", None)) and _made_by(
            make_te_forward, inspect.getattr_static(cls, "forward", None)):
        return True
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:  # built-in or no source
        return False
    if source is None:
        return False
    try:
        with open(source, encoding="utf-8") as file:
            return FORK_DIFF_MARKER in file.read()
    except OSError:
        return False


def te_attention_class():
    """megatron's ``TEDotProductAttention`` once the ``te-attention-hcp`` patch is applied (its
    CP groups then come from :func:`resolve_cp_groups`); refused, naming the patch, before."""
    reason = te_unavailable_reason()
    if reason is not None:
        raise TEUnavailableError(
            f"backend='te' needs Transformer Engine: {reason}. Fix the installation, or use "
            "backend='reference' (or 'auto', which falls back with a warning)")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    if not carries_te_cp_groups(TEDotProductAttention):
        raise TEUnavailableError(
            "the Transformer Engine attention backend needs the megatron-core patches "
            "['te-attention-hcp'] (without it TEDotProductAttention reads megatron's global "
            "hierarchical CP groups, not pg_collection.hcp); apply them first "
            "(megatron_hcp.patching.apply(megatron_hcp.patching.by_name(['te-attention-hcp'])) "
            "or `megatron-hcp patch apply`)")
    return TEDotProductAttention
