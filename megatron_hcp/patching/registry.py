"""Named, version-gated, revertible runtime patches of megatron-core (and Megatron-Bridge).

A :class:`Patch` replaces named attributes (functions, methods, class attributes) of one
package's modules (``package``: megatron-core by default). It applies only to the releases of
that package it was written for (``versions``); from the release that fixed the bug upstream
(``fixed_in``) on it is not needed and not applied; any other version is refused with a message.
A target can be limited to some of the patch's versions when upstream moved the code between
releases, can require the parameters the replacement relies on (``params``: checked before
anything changes), and can be rebound in every module of a package that imported it by value
(``also_bound_under``). The original is kept on the replacement itself
(``__megatron_hcp_original__``), so the patched objects carry their own state and revert is
exact.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from ..group_release import PATCHED_ORIGINAL

__all__ = [
    "Patch",
    "PatchError",
    "Target",
    "apply",
    "installed_version",
    "is_applied",
    "megatron_core_version",
    "revert",
    "version_key",
]

_ORIGINAL = PATCHED_ORIGINAL  # group_release follows it to the caches a patch wraps
_NAME = "__megatron_hcp_patch__"
MEGATRON_CORE = "megatron-core"


class PatchError(RuntimeError):
    """A patch cannot be applied (unsupported version, missing target, already patched)."""


def version_key(version: str) -> Version:
    """A release string as a comparable version; a malformed one is a :class:`PatchError`."""
    try:
        return Version(version)
    except InvalidVersion:
        raise PatchError(
            f"{version!r} is not a release version (expected e.g. 0.19.2)") from None


def megatron_core_version() -> str:
    """The installed megatron-core release, without a local ``+<git hash>`` suffix (0.19's
    ``package_info`` appends the hash of any git work tree it is installed in)."""
    from megatron.core import package_info

    return version_key(package_info.__version__).public


def installed_version(package: str) -> str | None:
    """The installed release of ``package`` (a distribution name), or None: its distribution
    metadata, else the ``package_info.__version__`` of its already imported top module."""
    if package == MEGATRON_CORE:
        return megatron_core_version()
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version_key(version(package)).public
    except PackageNotFoundError:
        pass
    info = sys.modules.get(f"{package.replace('-', '.')}.package_info")
    found = getattr(info, "__version__", None)
    return version_key(found).public if found else None


@dataclass(frozen=True)
class Target:
    """``module:qualname`` to replace; ``make(original)`` returns the replacement.

    ``versions``: the releases it exists on (None: every version of its patch). ``params``: the
    parameters the replacement relies on, first in this order. ``also_bound_under``: a package
    whose modules may hold the original by value (``from x import f``); those names are rebound.
    """

    module: str
    qualname: str
    make: Callable[[Any], Any]
    versions: tuple[str, ...] | None = None
    params: tuple[str, ...] | None = None
    also_bound_under: str | None = None

    def owner_and_attr(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, attr = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise PatchError(f"{self.module}:{self.qualname} does not exist in this release")
        return owner, attr

    def check_params(self) -> str | None:
        """Why the installed target's signature differs from the expected one, or None."""
        if self.params is None:
            return None
        owner, attr = self.owner_and_attr()
        have = list(inspect.signature(getattr(owner, attr)).parameters)
        if have[:len(self.params)] != list(self.params):
            return (f"{self.module}:{self.qualname}{tuple(have)}: expected the parameters "
                    f"{self.params} first")
        return None

    def by_value_holders(self, value: Any) -> list[tuple[Any, str]]:
        """(module, name) pairs under ``also_bound_under`` that hold ``value`` by value."""
        if self.also_bound_under is None:
            return []
        prefix = self.also_bound_under
        out = []
        for name, module in list(sys.modules.items()):
            if module is None or not (name == prefix or name.startswith(prefix + ".")):
                continue
            for key, held in list(vars(module).items()):
                if held is value and (name, key) != (self.module, self.qualname):
                    out.append((module, key))
        return out


@dataclass(frozen=True)
class Patch:
    """One named change of ``package``'s behaviour (megatron-core unless said otherwise).

    ``upstream`` names the file and line(s) it replaces (in the first of ``versions``);
    ``versions`` the releases it was written and tested for; ``fixed_in`` the first release
    whose own code makes the patch unnecessary.
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
    package: str = MEGATRON_CORE

    def installed(self) -> str | None:
        """The installed release of the patched package (None: not installed)."""
        return installed_version(self.package)

    def _version(self, version: str | None) -> str:
        version = version or self.installed()
        if version is None:
            raise PatchError(f"patch {self.name!r} needs {self.package}, which is not installed")
        return version

    def supports(self, version: str | None = None) -> bool:
        """Written for ``version`` (default: the installed release of its package)."""
        return self._version(version) in self.versions

    def fixed_upstream(self, version: str | None = None) -> bool:
        """``version`` already carries upstream's fix: the patch is not needed there."""
        version = self._version(version)
        return self.fixed_in is not None and version_key(version) >= version_key(self.fixed_in)

    def needed(self, version: str | None = None) -> bool:
        """Applied on ``version``: written for it, not fixed upstream, and something to change
        there (a target can exist on some of the patch's versions only)."""
        return (self.supports(version) and not self.fixed_upstream(version)
                and bool(self.targets_for(version)))

    def status(self, version: str | None = None) -> str:
        """One phrase for ``version``: written for it, fixed upstream, or not written for it."""
        if self.fixed_upstream(version):
            return f"fixed upstream in {self.fixed_in}"
        if self.supports(version) and not self.targets_for(version):
            return "nothing to change in this version (its code is not there)"
        if self.supports(version):
            return "written for this version"
        return "not written for this version"

    def targets_for(self, version: str | None = None) -> tuple[Target, ...]:
        """The targets that exist on ``version`` (upstream moves code between releases)."""
        version = self._version(version)
        return tuple(t for t in self.targets if t.versions is None or version in t.versions)

    def missing_requirement(self) -> str | None:
        """Why the patch cannot apply on this machine, or None."""
        if self.package != MEGATRON_CORE and self.installed() is None:
            return f"needs {self.package}, which is not installed here"
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


def _inner(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _current(target: Target) -> Any:
    owner, attr = target.owner_and_attr()
    return _inner(_raw(owner, attr))


def is_applied(patch: Patch) -> bool:
    """True when every target currently holds this patch's replacement. A target whose module
    this process never imported cannot hold it (applying imports it): the answer is False
    without importing anything (megatron.training's modules import modelopt and transformers,
    seconds of work a question must not cost)."""
    if patch.missing_requirement() or not patch.supports():
        return False
    targets = patch.targets_for()
    if not targets or any(t.module not in sys.modules for t in targets):
        return False
    return all(getattr(_current(t), _NAME, None) == patch.name for t in targets)


def _raw(owner: Any, attr: str) -> Any:
    """The attribute as stored (keeps staticmethod/classmethod wrappers)."""
    return owner.__dict__[attr] if attr in getattr(owner, "__dict__", {}) else getattr(owner, attr)


def apply(patches: Iterable[Patch], version: str | None = None) -> list[str]:
    """Apply ``patches`` (all or nothing); return the names newly applied.

    ``version`` stands for the installed release of each patch's package (tests). Patches fixed
    upstream in that release are skipped (not needed). Raises :class:`PatchError` before
    changing anything if a patch was not written for it, its package is missing, a target is
    missing or a target's signature differs from the one the patch was written against.
    """
    if version is not None:
        version_key(version)  # a malformed version is refused before anything else
    todo = []
    for patch in patches:
        missing = patch.missing_requirement()
        if missing and patch.package != MEGATRON_CORE:
            raise PatchError(f"patch {patch.name!r} {missing}")
        release = version or patch.installed()
        if patch.fixed_upstream(release) or is_applied(patch) or (
                patch.supports(release) and not patch.targets_for(release)):
            continue  # nothing to do: fixed, applied, or its code is not in this release
        if not patch.supports(release):
            raise PatchError(
                f"patch {patch.name!r} was written for {patch.package} "
                f"{', '.join(patch.versions)}, not {release}; refusing to change a release it "
                "was not tested against (install one of those versions)"
            )
        if missing:
            raise PatchError(f"patch {patch.name!r} {missing}")
        for target in patch.targets_for(release):
            target.owner_and_attr()
            wrong = target.check_params()
            if wrong:
                raise PatchError(f"patch {patch.name!r}: {wrong}; nothing was changed")
        todo.append((patch, release))
    done: list[tuple[Any, str, Any]] = []
    try:
        for patch, release in todo:
            for target in patch.targets_for(release):
                owner, attr = target.owner_and_attr()
                original = _raw(owner, attr)
                replacement = target.make(getattr(owner, attr))
                inner = _inner(replacement)
                setattr(inner, _ORIGINAL, original)
                setattr(inner, _NAME, patch.name)
                holders = target.by_value_holders(_inner(original))
                setattr(owner, attr, replacement)
                done.append((owner, attr, original))
                for module, key in holders:  # by-value imports elsewhere in the package
                    setattr(module, key, replacement)
                    done.append((module, key, _inner(original)))
    except Exception:
        for owner, attr, original in reversed(done):
            setattr(owner, attr, original)
        raise
    return [p.name for p, _ in todo]


def revert(patches: Iterable[Patch]) -> list[str]:
    """Restore the originals of applied ``patches`` (reverse order); return the names."""
    reverted = []
    for patch in reversed(list(patches)):
        if not is_applied(patch):
            continue
        for target in reversed(patch.targets_for()):
            owner, attr = target.owner_and_attr()
            current = _raw(owner, attr)
            original = getattr(_inner(current), _ORIGINAL)
            for module, key in target.by_value_holders(current):
                setattr(module, key, _inner(original))
            setattr(owner, attr, original)
        reverted.append(patch.name)
    return reverted
