"""Named, version-gated, revertible runtime patches of megatron-core.

A :class:`Patch` replaces named attributes (functions, methods, class attributes) of
megatron-core modules. It applies only to the upstream versions it was written for
(``versions``); from the release that fixed the bug upstream (``fixed_in``) on it is not needed
and not applied; any other version is refused with a message. A target can be limited to some of
the patch's versions when upstream moved the code between releases. The original is kept on the
replacement itself (``__megatron_hcp_original__``), so the patched objects carry their own state
and revert is exact.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

__all__ = [
    "Patch",
    "PatchError",
    "Target",
    "apply",
    "is_applied",
    "megatron_core_version",
    "revert",
    "version_key",
]

_ORIGINAL = "__megatron_hcp_original__"
_NAME = "__megatron_hcp_patch__"


class PatchError(RuntimeError):
    """A patch cannot be applied (unsupported version, missing target, already patched)."""


def megatron_core_version() -> str:
    """The installed megatron-core release, without a local ``+<git hash>`` suffix (0.19's
    ``package_info`` appends the hash of any git work tree it is installed in)."""
    from megatron.core import package_info

    return version_key(package_info.__version__).public


def version_key(version: str) -> Version:
    """A release string as a comparable version; a malformed one is a :class:`PatchError`."""
    try:
        return Version(version)
    except InvalidVersion:
        raise PatchError(
            f"{version!r} is not a megatron-core version (expected e.g. 0.19.2)") from None


@dataclass(frozen=True)
class Target:
    """``module:qualname`` to replace; ``make(original)`` returns the replacement."""

    module: str
    qualname: str
    make: Callable[[Any], Any]
    versions: tuple[str, ...] | None = None  # None: every version of its patch

    def owner_and_attr(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, attr = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise PatchError(f"{self.module}:{self.qualname} does not exist in this megatron-core")
        return owner, attr


@dataclass(frozen=True)
class Patch:
    """One named change of megatron-core behaviour.

    ``upstream`` names the file and line(s) it replaces (in the first of ``versions``);
    ``versions`` the megatron-core releases it was written and tested for; ``fixed_in`` the first
    release whose own code makes the patch unnecessary.
    """

    name: str
    summary: str
    upstream: str
    versions: tuple[str, ...]
    targets: tuple[Target, ...] = field(repr=False)
    category: str = "integration"
    requires_te: bool = False
    requires_modules: tuple[str, ...] = ()  # importable modules the targets need (e.g. CUDA)
    fixed_in: str | None = None

    def supports(self, version: str | None = None) -> bool:
        """Written for ``version`` (default: the installed megatron-core)."""
        return (version or megatron_core_version()) in self.versions

    def fixed_upstream(self, version: str | None = None) -> bool:
        """``version`` already carries upstream's fix: the patch is not needed there."""
        version = version or megatron_core_version()
        return self.fixed_in is not None and version_key(version) >= version_key(self.fixed_in)

    def needed(self, version: str | None = None) -> bool:
        """Applied on ``version``: written for it and not fixed upstream."""
        version = version or megatron_core_version()
        return self.supports(version) and not self.fixed_upstream(version)

    def status(self, version: str | None = None) -> str:
        """One phrase for ``version``: written for it, fixed upstream, or not written for it."""
        version = version or megatron_core_version()
        if self.fixed_upstream(version):
            return f"fixed upstream in {self.fixed_in}"
        if self.supports(version):
            return "written for this version"
        return "not written for this version"

    def targets_for(self, version: str | None = None) -> tuple[Target, ...]:
        """The targets that exist on ``version`` (upstream moves code between releases)."""
        version = version or megatron_core_version()
        return tuple(t for t in self.targets if t.versions is None or version in t.versions)

    def missing_requirement(self) -> str | None:
        """Why the patch cannot apply on this machine, or None."""
        if self.requires_te:
            from megatron.core.extensions import transformer_engine as te_ext

            if not getattr(te_ext, "HAVE_TE", False):
                return "needs Transformer Engine, which is not installed here"
        import importlib.util

        missing = [m for m in self.requires_modules if importlib.util.find_spec(m) is None]
        if missing:
            return f"needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} " \
                   "not installed here"
        return None


def _current(target: Target) -> Any:
    owner, attr = target.owner_and_attr()
    value = _raw(owner, attr)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def is_applied(patch: Patch) -> bool:
    """True when every target currently holds this patch's replacement."""
    if patch.missing_requirement() or not patch.supports():
        return False
    return all(getattr(_current(t), _NAME, None) == patch.name for t in patch.targets_for())


def _raw(owner: Any, attr: str) -> Any:
    """The attribute as stored (keeps staticmethod/classmethod wrappers)."""
    return owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)


def apply(patches: Iterable[Patch], version: str | None = None) -> list[str]:
    """Apply ``patches`` (all or nothing); return the names newly applied.

    Patches fixed upstream in the installed version are skipped (not needed). Raises
    :class:`PatchError` before changing anything if a patch was not written for the installed
    megatron-core version or a target is missing.
    """
    version = version or megatron_core_version()
    version_key(version)  # a malformed version is refused before anything else
    todo = [p for p in patches if not p.fixed_upstream(version) and not is_applied(p)]
    for patch in todo:
        if not patch.supports(version):
            raise PatchError(
                f"patch {patch.name!r} was written for megatron-core {', '.join(patch.versions)}, "
                f"not {version}; refusing to change an upstream version it was not tested "
                "against (install one of those versions)"
            )
        missing = patch.missing_requirement()
        if missing:
            raise PatchError(f"patch {patch.name!r} {missing}")
        for target in patch.targets_for(version):
            target.owner_and_attr()
    done: list[tuple[Any, str, Any]] = []
    try:
        for patch in todo:
            for target in patch.targets_for(version):
                owner, attr = target.owner_and_attr()
                original = _raw(owner, attr)
                replacement = target.make(getattr(owner, attr))
                inner = replacement.__func__ if isinstance(
                    replacement, (staticmethod, classmethod)) else replacement
                setattr(inner, _ORIGINAL, original)
                setattr(inner, _NAME, patch.name)
                setattr(owner, attr, replacement)
                done.append((owner, attr, original))
    except Exception:
        for owner, attr, original in reversed(done):
            setattr(owner, attr, original)
        raise
    return [p.name for p in todo]


def revert(patches: Iterable[Patch]) -> list[str]:
    """Restore the originals of applied ``patches`` (reverse order); return the names."""
    reverted = []
    for patch in reversed(list(patches)):
        if not is_applied(patch):
            continue
        for target in reversed(patch.targets_for()):
            owner, attr = target.owner_and_attr()
            current = _raw(owner, attr)
            inner = current.__func__ if isinstance(current, (staticmethod, classmethod)) else (
                current)
            setattr(owner, attr, getattr(inner, _ORIGINAL))
        reverted.append(patch.name)
    return reverted
