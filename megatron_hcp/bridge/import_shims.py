"""Import-only stand-ins for two packages Megatron-Bridge imports at module level but cannot use
on a machine without CUDA. They make ``import`` succeed and nothing else: any *use* fails.

* ``transformer_engine``: Bridge's ``peft/lora_layers.py`` (reached from ``training.pretrain``)
  imports ``transformer_engine.pytorch`` unconditionally; TE cannot be built without CUDA. The
  stand-in is installed *after* megatron-core's TE extension was imported, so megatron keeps
  ``HAVE_TE=False`` and never builds a TE layer.
* ``nvidia_resiliency_ext.inprocess``: Bridge's ``training/pretrain.py`` imports
  ``CallWrapper`` for its in-process restart (used only when ``inprocess_restart.enabled``).
  The registry's newest build for this machine (0.4.1) has no ``__version__``, which
  megatron-core 0.19.2's ``dist_checkpointing/strategies/nvrx.py`` asserts >= 0.6.0 at import,
  so installing it breaks megatron's checkpointing import. The stand-in's ``CallWrapper``
  raises when constructed; with it, Bridge's ``pretrain`` refuses in-process restart.

Each is installed only when the real package does not import (:func:`install`).
"""

from __future__ import annotations

import importlib.util
import sys
import types

from ..attention.te import IMPORT_SHIM_MARK as _MARK

__all__ = ["IMPORT_SHIMS", "install", "installed", "remove"]

IMPORT_SHIMS = ("transformer_engine", "nvidia_resiliency_ext")


class _AnyClass(type):
    """A class whose every attribute is another such class (``te.pytorch.Linear`` ...)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyClass(name, (), {})


class _AnyModule(types.ModuleType):
    """A module whose lower-case attributes are submodules and upper-case ones classes."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():
            sub = _AnyModule(f"{self.__name__}.{name}")
            sub.__path__ = []
            setattr(sub, _MARK, True)
            setattr(self, name, sub)
            sys.modules.setdefault(sub.__name__, sub)
            return sub
        return _AnyClass(name, (), {})


def _te_shim() -> None:
    import megatron.core.extensions.transformer_engine  # noqa: F401  (megatron keeps HAVE_TE=False)

    root = _AnyModule("transformer_engine")
    root.__path__ = []
    root.__version__ = "0.0.0+megatron-hcp-import-only"
    setattr(root, _MARK, True)
    sys.modules["transformer_engine"] = root
    for dotted in ("pytorch", "common", "common.recipe"):
        module = root
        for part in dotted.split("."):
            module = getattr(module, part)


class CallWrapper:
    """Import-only stand-in for ``nvidia_resiliency_ext.inprocess.CallWrapper``."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "nvidia_resiliency_ext is not installed (megatron-hcp put an import-only stand-in in "
            "its place): Bridge's in-process restart cannot run; set "
            "inprocess_restart.enabled=False or install nvidia-resiliency-ext >= 0.6")


def _nvrx_shim() -> None:
    root = types.ModuleType("nvidia_resiliency_ext")
    root.__path__ = []
    inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    inprocess.__path__ = []
    inprocess.CallWrapper = CallWrapper
    root.inprocess = inprocess
    for module in (root, inprocess):
        setattr(module, _MARK, True)
        sys.modules[module.__name__] = module


_MAKERS = {"transformer_engine": _te_shim, "nvidia_resiliency_ext": _nvrx_shim}


def _importable(name: str) -> bool:
    present = sys.modules.get(name)
    if present is not None:
        return not getattr(present, _MARK, False)
    return importlib.util.find_spec(name) is not None


def install() -> list[str]:
    """Put a stand-in in place of each package of :data:`IMPORT_SHIMS` that does not import;
    return the names of those now standing in (idempotent)."""
    for name in IMPORT_SHIMS:
        if not _importable(name) and name not in sys.modules:
            _MAKERS[name]()
    return installed()


def installed() -> list[str]:
    """The packages currently replaced by an import-only stand-in."""
    return [n for n in IMPORT_SHIMS if getattr(sys.modules.get(n), _MARK, False)]


def remove() -> None:
    """Take the stand-ins out of ``sys.modules`` (modules that imported them keep them)."""
    for name in [n for n in sys.modules if n.split(".")[0] in IMPORT_SHIMS]:
        if getattr(sys.modules[name], _MARK, False):
            del sys.modules[name]
