"""Fork-style patches: ``patches/megatron-core-<version>/NNNN-<name>.patch`` as unified diffs.

One diff per named runtime patch that a version needs (same names as ``megatron-hcp patch
list``), applied to a Megatron-LM checkout or an installed ``megatron`` package directory with
``git apply`` (atomic: all files of all patches, or nothing). ``check`` reports every patch of the
series for the target's version: applied, applicable or conflicting where a diff was written for
it, else "fixed upstream in X" or "not written for this version"; ``apply``/``revert`` refuse a
megatron-core version no diffs were written for and refuse to start when any patch conflicts.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..data import data_dir
from .registry import Patch, PatchError, version_key

__all__ = ["SERIES", "PATCHES_DIR", "PatchStatus", "applied_in_source", "apply_diffs",
           "check_diffs", "diff_digest", "megatron_package_dir", "read_header", "revert_diffs",
           "runtime_digest", "series_for", "target_root", "target_version"]

PATCHES_DIR = data_dir("patches")

# the order of the series: CPU runtime first (cpu-schedules-device adds megatron/core/
# cpu_runtime.py, which the other CPU patches import), then the integration patches
SERIES: tuple[str, ...] = (
    "cpu-schedules-device", "cpu-p2p-device", "cpu-global-memory-buffer", "cpu-ddp-buffers",
    "cpu-rope-device", "cpu-attention-masks", "cpu-optimizer-device", "cpu-grad-norm-device",
    "cpu-mtp-loss-tracker", "cpu-rope-cp-index", "cpu-rng-tracker", "cpu-tied-embedding-sync",
    "attention-dynamic-cp-rope", "cross-entropy-model-tp-group", "destroy-forgets-stale-groups",
    "te-attention-hcp", "p2p-variable-seq-lengths", "chained-optimizer-count-zeros-tp-group",
    "mtp-dynamic-cp-group", "mamba-dynamic-cp-group", "pg-collection-repr",
)


def series_for(version: str) -> list[str]:
    """The names of the patches ``version`` needs, in series order (each has one diff)."""
    from . import by_name

    return [p.name for p in by_name(list(SERIES)) if p.needed(version)]


def megatron_package_dir() -> Path:
    """The installed ``megatron`` package directory."""
    import megatron.core

    return Path(megatron.core.__file__).resolve().parent.parent


def _names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _project_sources(obj, seen: set[int]) -> list[str]:
    """Source of ``obj`` and, transitively, of the project functions and classes it uses."""
    if id(obj) in seen or not getattr(obj, "__module__", "").startswith("megatron_hcp"):
        return []
    seen.add(id(obj))
    try:
        out = [inspect.getsource(obj)]
    except (OSError, TypeError):
        return [repr(obj)]
    code = getattr(obj, "__code__", None)
    scope = getattr(obj, "__globals__", None)
    if code is not None and scope is not None:
        for name in sorted(_names(code)):
            used = scope.get(name)
            if inspect.isfunction(used) or inspect.isclass(used):
                out += _project_sources(used, seen)
    return out


def runtime_digest(patch: Patch, version: str) -> str:
    """Digest of the source of a runtime patch's replacements on ``version`` and of every project
    function or class they use (what that version's diff must mirror)."""
    h = hashlib.sha256()
    h.update(f"{patch.name}|{patch.versions}|{version}".encode())
    seen: set[int] = set()
    for target in patch.targets_for(version):
        h.update(f"{target.module}:{target.qualname}".encode())
        for source in _project_sources(target.make, seen):
            h.update(source.encode())
    return h.hexdigest()[:16]


def _diff_files(body: str) -> list[tuple[str, bool]]:
    """(path, is a new file) of every file a diff body touches."""
    out = []
    for block in re.split(r"^diff --git ", body, flags=re.M)[1:]:
        path = block.split()[0].removeprefix("a/")
        out.append((path, "\nnew file mode" in block.split("\n@@", 1)[0]))
    return out


def applied_in_source(patch: Patch) -> bool:
    """True when the imported megatron-core carries this patch's fork diff (megatron-core
    patched with ``patches/`` instead of at run time): every file the installed version's diff
    edits holds its ``megatron-hcp <name>`` marker, every file it adds exists."""
    from .registry import megatron_core_version

    version = megatron_core_version()
    files = [f for f in _series(version) if read_header(f).get("Patch-Name") == patch.name]
    if not files:
        return False
    root = megatron_package_dir().parent
    marker = f"megatron-hcp {patch.name}"
    for path, new in _diff_files(read_header(files[0])["body"]):
        file = root / path
        if not file.is_file() or (not new and marker not in file.read_text(encoding="utf-8")):
            return False
    return True


def diff_digest(diff: str) -> str:
    return hashlib.sha256(diff.encode()).hexdigest()[:16]


def read_header(path: Path) -> dict[str, str]:
    """``Key: value`` lines of a patch header (up to the ``---`` line) plus ``body``."""
    text = path.read_text(encoding="utf-8")
    head, sep, body = text.partition("\n---\n")
    if not sep:
        raise PatchError(f"{path}: no '---' line between header and diff")
    fields = dict(re.findall(r"^([A-Z][A-Za-z-]+): (.*)$", head, flags=re.M))
    fields["body"] = body
    return fields


def target_root(path: str | Path) -> Path:
    """Directory whose ``megatron/core`` the diffs apply to (checkout or package directory)."""
    p = Path(path).resolve()
    if (p / "megatron" / "core" / "package_info.py").is_file():
        return p
    if p.name == "megatron" and (p / "core" / "package_info.py").is_file():
        return p.parent
    raise PatchError(f"{path}: neither a Megatron-LM checkout (megatron/core/package_info.py) "
                     "nor an installed megatron package directory (core/package_info.py)")


def target_version(root: Path) -> str:
    """megatron-core version of a target, read from package_info.py (never imported)."""
    text = (root / "megatron" / "core" / "package_info.py").read_text(encoding="utf-8")
    parts = {k: v for k, v in re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", text, flags=re.M)}
    if len(parts) != 3:
        raise PatchError(f"cannot read the megatron-core version from {root}")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def diff_versions() -> list[str]:
    """The megatron-core versions that have fork-style diffs."""
    return sorted((p.name.removeprefix("megatron-core-") for p in PATCHES_DIR.glob(
        "megatron-core-*") if p.is_dir() and any(p.glob("*.patch"))), key=version_key)


def _series(version: str) -> list[Path]:
    """The diff files of ``version`` (empty when none were written for it)."""
    folder = PATCHES_DIR / f"megatron-core-{version}"
    return sorted(folder.glob("*.patch")) if folder.is_dir() else []


def _require_series(version: str) -> list[Path]:
    files = _series(version)
    if not files:
        raise PatchError(f"no fork patches for megatron-core {version}; written for "
                         f"{diff_versions()} (install or check out one of those versions)")
    return files


def _git_apply(root: Path, files: list[Path], *args: str) -> subprocess.CompletedProcess:
    # --unsafe-paths/--directory are not needed: paths are relative to root (cwd)
    return subprocess.run(["git", "apply", "--whitespace=nowarn", *args, *map(str, files)],
                          cwd=root, capture_output=True, text=True)


@dataclass(frozen=True)
class PatchStatus:
    name: str
    file: Path | None  # None: no diff for this version
    state: str  # applied | applicable | conflicts | fixed upstream in X | not written for ...
    detail: str = ""

    @property
    def has_diff(self) -> bool:
        return self.file is not None


def check_diffs(path: str | Path) -> tuple[str, list[PatchStatus]]:
    """(version, status of every patch of the series) for a target; never writes.

    Patches with a diff for the target's version are applied, applicable or conflicting; the
    others are "fixed upstream in X" or "not written for this version".
    """
    from . import by_name

    root = target_root(path)
    version = target_version(root)
    files = {read_header(f).get("Patch-Name", f.stem): f for f in _series(version)}
    out = []
    for patch in by_name(list(SERIES)):
        file = files.get(patch.name)
        if file is None:
            out.append(PatchStatus(patch.name, None, patch.status(version)))
            continue
        if _git_apply(root, [file], "--check", "-R").returncode == 0:
            out.append(PatchStatus(patch.name, file, "applied"))
            continue
        res = _git_apply(root, [file], "--check")
        out.append(PatchStatus(patch.name, file,
                               "applicable" if res.returncode == 0 else "conflicts",
                               res.stderr.strip()))
    return version, out


def apply_diffs(path: str | Path) -> list[str]:
    """Apply every not-yet-applied diff in one atomic ``git apply``; return their names."""
    root = target_root(path)
    _require_series(target_version(root))
    version, statuses = check_diffs(root)
    bad = [s for s in statuses if s.state == "conflicts"]
    if bad:
        raise PatchError(f"megatron-core {version} at {root}: "
                         + "; ".join(f"{s.name} conflicts ({s.detail})" for s in bad)
                         + " - nothing was changed")
    todo = [s for s in statuses if s.state == "applicable"]
    if todo:
        res = _git_apply(root, [s.file for s in todo])
        if res.returncode:
            raise PatchError(f"git apply failed, nothing was changed: {res.stderr.strip()}")
    return [s.name for s in todo]


def revert_diffs(path: str | Path) -> list[str]:
    """Revert every applied diff (newest first) in one atomic ``git apply -R``."""
    root = target_root(path)
    _require_series(target_version(root))
    version, statuses = check_diffs(root)
    applied = [s for s in statuses if s.state == "applied"]
    if applied:
        res = _git_apply(root, [s.file for s in reversed(applied)], "-R")
        if res.returncode:
            raise PatchError(f"git apply -R failed, nothing was changed: {res.stderr.strip()}")
    return [s.name for s in reversed(applied)]
