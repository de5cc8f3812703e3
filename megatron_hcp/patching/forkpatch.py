"""Fork-style patches: ``patches/megatron-core-<version>/NNNN-<name>.patch`` as unified diffs.

One diff per named runtime patch that a version needs (same names as ``megatron-hcp patch
list``), applied to a Megatron-LM checkout or an installed ``megatron`` package directory by this
module's own diff engine (no git: a target inside another git work tree is patched like any
other) as a transaction (:mod:`.transaction`: a lock per target, a journal written before the
first change, recovery of an interrupted transaction by the next apply, revert or check), and
a read-back check that the files carry the change before "applied" is said. ``check`` reports
every patch of the series for the target's version: applied, applicable or conflicting where a
diff was written for it, else "fixed upstream in X" or "not written for this version";
``apply``/``revert`` refuse a megatron-core version no diffs were written for and refuse to
start when any patch conflicts.

A diff applies to a file's own bytes: its lines match whatever their line endings (LF, CRLF,
CR), kept lines keep theirs and added lines take those of their neighbours, so a CRLF file
stays CRLF and a revert gives back the original bytes. A file a diff touches must be UTF-8
(else a named refusal, before any write); no other file of the target is decoded.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..files.atomic_write import Step
from ..files.data import data_dir
from .registry import Patch, PatchError, version_key
from .transaction import (
    DEFAULT_LOCK_TIMEOUT,
    Notify,
    journal_present,
    read_target,
    recover,
    run_transaction,
    target_lock,
)

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
    "attention-dynamic-cp-rope", "rope-cp-partition-mode", "cross-entropy-model-tp-group",
    "destroy-forgets-stale-groups", "te-attention-hcp", "p2p-variable-seq-lengths",
    "chained-optimizer-count-zeros-tp-group", "mtp-dynamic-cp-group", "mamba-dynamic-cp-group",
    "pg-collection-repr", "cpu-sequence-parallel", "mla-without-te", "cpu-timers",
    "cpu-dist-checkpointing", "cpu-ddp-wrap", "cpu-moe-router-device",
    "moe-router-gating-without-te", "cpu-moe-alltoall-dispatcher", "moe-metrics-collection-dp",
    "cpu-yarn-rope-device", "mtp-collection-groups", "mla-tp-group", "yarn-rope-model-cp-group",
    "row-parallel-tp1-output", "hybrid-final-norm-without-te", "moe-allgather-variable-tokens",
    "mla-dynamic-cp-group", "moe-router-dynamic-cp-group",
)


def series_for(version: str) -> list[str]:
    """The names of the patches ``version`` needs, in series order (each has one diff; a patch
    whose targets do not exist on ``version`` is not needed there and has none)."""
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
    marker = f"megatron-hcp {patch.name}".encode()
    for path, new in _diff_files(read_header(files[0])["body"]):
        file = root / path
        if not file.is_file() or (not new and marker not in file.read_bytes()):
            return False
    return True


def diff_digest(diff: str) -> str:
    return hashlib.sha256(diff.encode()).hexdigest()[:16]


def read_header(path: Path) -> dict[str, str]:
    """``Key: value`` lines of a patch header (up to the ``---`` line) plus ``body``."""
    st = os.stat(path)
    return dict(_header(str(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=256)
def _header(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, str], ...]:
    """:func:`read_header` of one version of a file (a command reads each patch many times)."""
    text = Path(path).read_text(encoding="utf-8")
    head, sep, body = text.partition("\n---\n")
    if not sep:
        raise PatchError(f"{path}: no '---' line between header and diff")
    fields = dict(re.findall(r"^([A-Z][A-Za-z-]+): (.*)$", head, flags=re.M))
    fields["body"] = body
    return tuple(fields.items())


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
    """megatron-core version of a target, read from package_info.py (never imported; only its
    ASCII ``MAJOR``/``MINOR``/``PATCH`` lines matter, so other bytes never break the read)."""
    data = (root / "megatron" / "core" / "package_info.py").read_bytes()
    text = data.decode("utf-8", errors="replace")
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


# ---------------------------------------------------------------- the diff engine
# Our own diffs are applied by this module, not by ``git apply``: git skips every path when the
# target lies inside another git work tree (e.g. a virtualenv inside a repository) and still
# succeeds. Nothing here depends on git or on the target's surroundings.


class _Conflict(Exception):
    """A hunk does not match the file (reason in the message)."""


@dataclass(frozen=True)
class _Hunk:
    old_start: int  # 1-based line of the old side
    new_start: int
    lines: tuple[tuple[str, str], ...]  # (" " context | "-" removed | "+" added, the line)


@dataclass(frozen=True)
class _FileDiff:
    path: str  # relative to the target root (megatron/core/...)
    new_file: bool
    hunks: tuple[_Hunk, ...]


_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")


@functools.lru_cache(maxsize=64)
def _parse_diff(body: str) -> tuple[_FileDiff, ...]:
    """The file diffs of a unified diff written by ``patches/generate.py`` (kept per body: a
    transaction simulates the same diffs several times)."""
    out = []
    for block in re.split(r"^diff --git ", body, flags=re.M)[1:]:
        lines = block.splitlines(keepends=True)
        path = lines[0].split()[0].removeprefix("a/")
        new_file = any(ln.startswith("new file mode") for ln in lines[1:4])
        hunks, cur = [], None
        for line in lines[1:]:
            m = _HUNK.match(line)
            if m:
                cur = (int(m.group(1)), int(m.group(2)), [])
                hunks.append(cur)
            elif cur is not None and line[:1] in (" ", "-", "+"):
                cur[2].append((line[0], line[1:]))
        out.append(_FileDiff(path, new_file, tuple(
            _Hunk(a, b, tuple(ops)) for a, b, ops in hunks)))
    return tuple(out)


_REVERSED = {" ": " ", "-": "+", "+": "-"}


def _eol(line: str) -> str:
    """The line break ending ``line`` (LF, CRLF or CR), else ''."""
    if line.endswith("\n"):
        return "\r\n" if line.endswith("\r\n") else "\n"
    return "\r" if line.endswith("\r") else ""


def _key(line: str) -> str:
    """``line`` as compared with a diff's: its line break, whichever, as LF."""
    if line.endswith("\r\n"):
        return line[:-2] + "\n"
    return line[:-1] + "\n" if line.endswith("\r") else line


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)  # as patches/generate.py split them


def _matches(keys: list[str], old: list[str], start: int) -> list[int]:
    """Every position from ``start`` where ``keys`` continue with ``old``."""
    n = len(old)
    if not n:
        return list(range(start, len(keys) + 1))
    found, p, last = [], start, len(keys) - n
    while p <= last:
        try:
            p = keys.index(old[0], p, last + 1)
        except ValueError:
            break
        if keys[p:p + n] == old:
            found.append(p)
        p += 1
    return found


def _patch_text(text: str | None, diff: _FileDiff, reverse: bool) -> str | None:
    """``text`` with ``diff`` applied (or reverted); None is an absent file. Lines match
    whatever their line endings; kept lines keep theirs, added lines take the ending of the
    file line before them (the first hunk line: the file's first ending, else LF)."""
    if diff.new_file:
        content = "".join(t for tag, t in diff.hunks[0].lines if tag == "+") if diff.hunks else ""
        if reverse:
            if text is None or list(map(_key, _lines(text))) != list(map(_key, _lines(content))):
                raise _Conflict(f"{diff.path}: differs from the file this diff adds")
            return None
        if text is not None:
            raise _Conflict(f"{diff.path}: already exists")
        return content
    if text is None:
        raise _Conflict(f"{diff.path}: missing")
    lines = _lines(text)
    # without a CR every line already ends as its key (the common case, and 2/3 of the time)
    keys = list(map(_key, lines)) if "\r" in text else list(lines)
    first_eol = next((e for e in map(_eol, lines) if e), "\n")
    cursor, delta = 0, 0
    for hunk in diff.hunks:
        ops = [(_REVERSED[tag] if reverse else tag, line) for tag, line in hunk.lines]
        old = [_key(line) for tag, line in ops if tag != "+"]
        expected = (hunk.new_start if reverse else hunk.old_start) - 1 + delta
        n = len(old)
        found = _matches(keys, old, cursor)
        if not found:
            raise _Conflict(f"{diff.path}: the hunk at line {expected + 1} does not match "
                            "(the region was edited)")
        pos = min(found, key=lambda p: abs(p - expected))
        eol = (_eol(lines[pos - 1]) if pos else "") or first_eol
        new, at = [], pos
        for tag, line in ops:
            if tag == "+":
                new.append(line[:-len(_eol(line))] + eol if _eol(line) else line)
                continue
            if tag == " ":
                new.append(lines[at])  # the file's own line, its own ending
            eol = _eol(lines[at]) or eol
            at += 1
        lines[pos:pos + n] = new
        keys[pos:pos + n] = map(_key, new)
        cursor = pos + len(new)
        delta += len(new) - n
    return "".join(lines)


def _read(root: Path, rel: str) -> str | None:
    """The text of a file a diff touches (None: absent), from its bytes, never through a link
    (:func:`.transaction.read_target`); a file that is not UTF-8 is a named PatchError."""
    data = read_target(root, rel)
    try:
        return None if data is None else data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PatchError(f"the patch target file {str(root / rel)!r}: is not UTF-8 text "
                         f"({err.reason} at byte {err.start}), and the fork diffs change it; "
                         "restore the file (e.g. reinstall megatron-core) and run this again"
                         ) from None


Texts = dict[str, "str | None"]
"""Target files read so far by one command, by path (a command reads each file once)."""


def _text(root: Path, rel: str, texts: Texts | None) -> str | None:
    """:func:`_read`, through the command's cache ``texts`` (None: no cache)."""
    if texts is None:
        return _read(root, rel)
    if rel not in texts:
        texts[rel] = _read(root, rel)
    return texts[rel]


def _simulate(root: Path, files: list[Path], reverse: bool,
              texts: Texts | None = None) -> dict[str, str | None]:
    """New contents after applying (or reverting) ``files`` in order, in memory."""
    state: dict[str, str | None] = {}
    for file in files:
        for diff in _parse_diff(read_header(file)["body"]):
            if diff.path not in state:
                state[diff.path] = _text(root, diff.path, texts)
            state[diff.path] = _patch_text(state[diff.path], diff, reverse)
    return state


def _encoded(state: dict[str, str | None]) -> dict[str, bytes | None]:
    """The bytes a transaction writes (a strict UTF-8 decode and encode round-trips exactly)."""
    return {path: None if text is None else text.encode("utf-8") for path, text in state.items()}


def _marker_present(root: Path, file: Path, name: str, texts: Texts | None = None) -> bool:
    marker = f"megatron-hcp {name}"
    for diff in _parse_diff(read_header(file)["body"]):
        text = _text(root, diff.path, texts)
        if text is None or (not diff.new_file and marker not in text):
            return False
    return True


@dataclass(frozen=True)
class PatchStatus:
    name: str
    file: Path | None  # None: no diff for this version
    state: str  # applied | applicable | conflicts | fixed upstream in X | not written for ...
    detail: str = ""

    @property
    def has_diff(self) -> bool:
        return self.file is not None


def check_diffs(path: str | Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                notify: Notify | None = None, on_step: Step | None = None
                ) -> tuple[str, list[PatchStatus]]:
    """(version, status of every patch of the series) for a target; writes no patched file.

    Patches with a diff for the target's version are applied, applicable or conflicting; the
    others are "fixed upstream in X" or "not written for this version". Runs under the
    target's lock and first finishes an interrupted transaction (``notify`` hears which); a
    target this process cannot write to is read without the lock when nobody holds it."""
    root = target_root(path)
    with target_lock(root / "megatron", timeout=lock_timeout, notify=notify,
                     read_only_ok=True) as locked:
        if locked:
            _recover(root, notify, on_step)
        elif journal_present(root):
            raise PatchError(f"{root}: an interrupted patch transaction left a journal, and "
                             "this process cannot write there to finish it; run patch check "
                             "as a user who can write to the target")
        return _check(root)


def _recover(root: Path, notify: Notify | None, on_step: Step | None) -> None:
    message = recover(root, on_step=on_step)
    if message and notify is not None:
        notify(message)


def _check(root: Path, texts: Texts | None = None) -> tuple[str, list[PatchStatus]]:
    """(version, every patch's status) of the files as they are now; ``texts`` caches the
    files read (a command that writes nothing in between passes it on)."""
    from . import by_name

    texts = {} if texts is None else texts
    version = target_version(root)
    files = {read_header(f).get("Patch-Name", f.stem): f for f in _series(version)}
    out = []
    for patch in by_name(list(SERIES)):
        file = files.get(patch.name)
        if file is None:
            out.append(PatchStatus(patch.name, None, patch.status(version)))
            continue
        try:
            _simulate(root, [file], reverse=True, texts=texts)
            if _marker_present(root, file, patch.name, texts):
                out.append(PatchStatus(patch.name, file, "applied"))
                continue
        except _Conflict:
            pass
        try:
            _simulate(root, [file], reverse=False, texts=texts)
            out.append(PatchStatus(patch.name, file, "applicable"))
        except _Conflict as err:
            out.append(PatchStatus(patch.name, file, "conflicts", str(err)))
    return version, out


def apply_diffs(path: str | Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                notify: Notify | None = None, on_step: Step | None = None) -> list[str]:
    """Apply every not-yet-applied diff as one transaction; return their names.

    Refuses (changing nothing) when any diff conflicts. Runs under the target's lock and first
    finishes an interrupted transaction (:mod:`.transaction`); every file is written or none
    is (journal first), and is read back afterwards; then the target is checked again: each
    applied diff must be found in the files (its changes and its ``megatron-hcp <name>``
    markers). ``on_step`` is called before every write (fault injection)."""
    root = target_root(path)
    _require_series(target_version(root))
    with target_lock(root / "megatron", timeout=lock_timeout, notify=notify):
        _recover(root, notify, on_step)
        return _apply(root, on_step)


def _apply(root: Path, on_step: Step | None) -> list[str]:
    texts: Texts = {}
    version, statuses = _check(root, texts)
    bad = [s for s in statuses if s.state == "conflicts"]
    if bad:
        raise PatchError(f"megatron-core {version} at {root}: "
                         + "; ".join(f"{s.name} conflicts ({s.detail})" for s in bad)
                         + " - nothing was changed")
    todo = [s for s in statuses if s.state == "applicable"]
    if todo:
        try:
            changes = _simulate(root, [s.file for s in todo], reverse=False, texts=texts)
        except _Conflict as err:  # two diffs overlap in a way the check could not see
            raise PatchError(f"{err} - nothing was changed") from err
        run_transaction(root, _encoded(changes), "patch apply", [s.name for s in todo],
                        on_step=on_step)
        _verify(root, todo, "applied")
    return [s.name for s in todo]


def revert_diffs(path: str | Path, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                 notify: Notify | None = None, on_step: Step | None = None) -> list[str]:
    """Revert every applied diff (newest first) as one transaction; return their names.

    A diff whose region was edited since it was applied (state "conflicts") makes the whole
    revert refuse, naming the file, before anything is written. Lock, recovery and journal
    as :func:`apply_diffs`."""
    root = target_root(path)
    _require_series(target_version(root))
    with target_lock(root / "megatron", timeout=lock_timeout, notify=notify):
        _recover(root, notify, on_step)
        return _revert(root, on_step)


def _revert(root: Path, on_step: Step | None) -> list[str]:
    texts: Texts = {}
    version, statuses = _check(root, texts)
    bad = [s for s in statuses if s.state == "conflicts"]
    if bad:
        raise PatchError(f"megatron-core {version} at {root}: cannot revert "
                         + "; ".join(f"{s.name} ({s.detail})" for s in bad)
                         + " - nothing was changed; restore those files (e.g. reinstall "
                         "megatron-core) or revert the edit first")
    applied = [s for s in reversed(statuses) if s.state == "applied"]
    if applied:
        try:
            changes = _simulate(root, [s.file for s in applied], reverse=True, texts=texts)
        except _Conflict as err:
            raise PatchError(f"{err} - nothing was changed") from err
        run_transaction(root, _encoded(changes), "patch revert", [s.name for s in applied],
                        on_step=on_step)
        _verify(root, applied, "applicable")
    return [s.name for s in applied]


def _verify(root: Path, done: list[PatchStatus], want: str) -> None:
    """After a transaction: every diff it handled is now in state ``want`` when read back."""
    _, after = _check(root)
    state = {s.name: s.state for s in after}
    wrong = [f"{s.name} is {state[s.name]}" for s in done if state[s.name] != want]
    if wrong:
        raise PatchError(f"after writing, the files do not carry what was written: "
                         f"{'; '.join(wrong)}")
