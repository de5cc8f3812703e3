"""Atomic file writes whose temporary files say who wrote them, so that strays can be reclaimed.

:func:`write_atomic` writes ``<dir>/<name>.<pid>.<random>.tmp`` (unique: two writers never
share a temporary file), fsyncs it, renames it over ``<dir>/<name>`` and fsyncs the directory:
a reader sees the old file or the new one, never a mix. A process killed in between leaves its
temporary file behind; :func:`reclaim_temps` removes those whose writer (the pid in the name)
is no longer running, and keeps the files of a writer that is still at work.

``on_step`` (optional) is called with a description before each write that changes the disk
(the temporary file, the rename): the fault-injection point of the crash tests.

A write the file system refuses for want of room or of a writable disk (ENOSPC, EDQUOT, EROFS)
raises :class:`OutputWriteError`: one line naming the path (the command line prints it and
exits 1), nothing partial left. The output checks (:func:`check_output_file`,
:func:`check_output_dir`) find such a file system before any work: they write, sync and remove
a small probe file there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["PLOT_SUFFIXES", "OutputPathError", "OutputWriteError", "Step", "check_output_dir",
           "check_output_file", "fsync_dir", "naming_write_errors", "pid_alive",
           "reclaim_temps", "save_figure", "temp_files", "write_atomic"]

PLOT_SUFFIXES = ("", ".png", ".pdf", ".svg")
"""What a ``--plot`` file may end with (matplotlib writes PNG without a suffix)."""


class OutputPathError(ValueError):
    """An output path that cannot be written (found before any work starts; one line)."""


# the errors of a write the file system refuses whatever is written, and what each means
REFUSED_WRITES = {errno.ENOSPC: "the file system is full (ENOSPC)",
                  errno.EDQUOT: "the disk quota is exceeded (EDQUOT)",
                  errno.EROFS: "the file system is read-only (EROFS)"}


class OutputWriteError(OSError):
    """A write the file system refused (:data:`REFUSED_WRITES`), one line naming what was being
    written (a path, shown quoted, or a description such as ``the standard output``); an
    OSError with the original ``errno``, so ``except OSError`` still catches it."""

    def __init__(self, code: int, what: str | os.PathLike) -> None:
        shown = repr(str(what)) if isinstance(what, os.PathLike) else what  # whole: its name
        super().__init__(code, f"cannot write {shown}: {REFUSED_WRITES[code]}; free space "
                               "there or write elsewhere")
        self.filename = str(what)

    def __str__(self) -> str:
        return self.strerror


@contextlib.contextmanager
def naming_write_errors(what: str | os.PathLike) -> Iterator[None]:
    """Within the block, a write the file system refuses (:data:`REFUSED_WRITES`) raises
    :class:`OutputWriteError` naming ``what`` (a path, or a description); other errors pass
    unchanged."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as err:
        if err.errno not in REFUSED_WRITES:
            raise
        raise OutputWriteError(err.errno, what) from err


Step = Callable[[str], None]
"""Called with a description before each change on disk (fault-injection point)."""


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_atomic(path: Path, data: bytes | str, *, mode: int | None = None,
                 on_step: Step | None = None) -> None:
    """Replace ``path`` with ``data``: unique temporary file, fsync, rename, fsync directory. A
    full or read-only file system raises :class:`OutputWriteError` naming ``path``; the old
    file stays and no temporary file is left.

    ``mode``: permission bits of the new file (default: those of the file it replaces, else
    0o666 minus the umask, as ``open`` would create it)."""
    path = Path(path)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if on_step is not None:
        on_step(f"write a temporary file for {path}")
    with naming_write_errors(path):
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.{os.getpid()}.", suffix=".tmp",
                                   dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fchmod(fh.fileno(), mode)
                os.fsync(fh.fileno())
            if on_step is not None:
                on_step(f"rename the temporary file onto {path}")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def _writable_dir(folder: Path, name: str, path: str | os.PathLike) -> None:
    if not folder.is_dir():
        raise OutputPathError(f"{name} {str(path)!r}: the directory {str(folder)!r} does not "
                              "exist; create it first or give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{name} {str(path)!r}: cannot write into {str(folder)!r} "
                              "(permission); give a writable location")
    _probe(folder, name, path)


PROBE_BYTES = 4096  # a block: a full file system refuses it


def _probe(folder: Path, name: str, path: str | os.PathLike) -> None:
    """Write, sync and remove a small file in ``folder``: a full, over-quota or read-only file
    system (which ``os.access`` does not see) is refused now, not after the work."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".megatron-hcp-probe.{os.getpid()}.",
                                     suffix=".tmp", dir=folder)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        reason = REFUSED_WRITES.get(err.errno or 0, err.strerror)
        raise OutputPathError(f"{name} {str(path)!r}: cannot write into {str(folder)!r}: "
                              f"{reason}; free space there or give another path") from None


def _shown(path: str | os.PathLike) -> str:
    text = repr(str(path))
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def check_output_file(path: str | os.PathLike | None, name: str,
                      suffixes: tuple[str, ...] = PLOT_SUFFIXES) -> Path:
    """The file an output option will write - ``NAME`` without a suffix is ``NAME.png``, as
    matplotlib writes it - checked before any work: a name within the file system's limits, a
    known type, a writable directory, and nothing there but a regular file (never a directory,
    a FIFO or a device such as ``/dev/full``). Returns that path."""
    text = "" if path is None else str(path)
    if not text.strip():
        raise OutputPathError(f"{name} {_shown(text)}: is empty; give a file name such as "
                              "out.png")
    file = Path(text)
    if file.suffix.lower() not in suffixes:
        raise OutputPathError(f"{name} {_shown(text)}: unknown file type {file.suffix[:20]!r}; "
                              f"end the name with one of {', '.join(s for s in suffixes if s)}")
    given, file = file, file if file.suffix else file.with_name(file.name + ".png")
    if len(os.fsencode(file.name)) > 255 or len(os.fsencode(str(file))) > 4095:
        raise OutputPathError(f"{name} {_shown(text)}: the name is longer than the file system "
                              "allows (255 bytes a name, 4095 a path); give a shorter one")
    mode = None
    for candidate in dict.fromkeys((given, file)):  # what was named, and what is written
        try:
            mode = os.stat(candidate).st_mode
        except FileNotFoundError:
            mode = None
            continue
        except OSError as err:
            if err.errno == errno.ENOTDIR:  # a part of the path before the name is a file
                folder = next((p for p in reversed(candidate.parents)
                               if p.exists() and not p.is_dir()), candidate.parent)
                raise OutputPathError(f"{name} {_shown(candidate)}: {_shown(folder)} is not a "
                                      "directory; give a path inside a directory") from None
            raise OutputPathError(f"{name} {_shown(candidate)}: cannot be checked "
                                  f"({err.strerror}); give another path") from None
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode)
                    else "not a regular file (a FIFO or a device)")
            raise OutputPathError(f"{name} {_shown(candidate)} is {kind}; give a file name "
                                  "such as out.png")
    _writable_dir(file.parent if str(file.parent) else Path("."), name, text)
    if mode is not None and not os.access(file, os.W_OK):
        raise OutputPathError(f"{name} {_shown(file)} exists and cannot be overwritten "
                              "(permission); give another path")
    return file


def save_figure(fig: object, path: Path, **kwargs: object) -> Path:
    """Write a matplotlib figure to ``path`` (checked by :func:`check_output_file`) atomically:
    a temporary file beside it, then a rename; returns ``path``. A full or read-only file system
    raises :class:`OutputWriteError` and leaves nothing."""
    fmt = path.suffix.lstrip(".").lower() or "png"
    with naming_write_errors(path):
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.{os.getpid()}.", suffix=".tmp",
                                   dir=path.parent)
        os.close(fd)
        try:
            fig.savefig(tmp, format=fmt, **kwargs)  # type: ignore[attr-defined]
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def check_output_dir(path: str | os.PathLike, name: str) -> Path:
    """Refuse, before any work, an output directory that could not be created or written."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{name} {str(path)!r} exists and is not a directory; give a "
                              "directory")
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent  # the nearest existing ancestor is where mkdir starts
    if not existing.is_dir():
        raise OutputPathError(f"{name} {str(path)!r}: {str(existing)!r} is not a directory, "
                              "so the directory cannot be created; give another path")
    _writable_dir(existing, name, path)
    return folder


def temp_files(path: Path) -> list[tuple[Path, int | None]]:
    """Temporary files of ``path`` in its directory, with their writer's pid (None: a name
    without one, written by an older version of this project)."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.(?:(\d+)\.)?[a-z0-9_]+\.tmp")
    legacy = f".{path.name}.megatron-hcp.tmp"  # the fixed name of older patch transactions
    out: list[tuple[Path, int | None]] = []
    try:
        entries = sorted(path.parent.iterdir())
    except FileNotFoundError:
        return out
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match:
            out.append((entry, int(match.group(1)) if match.group(1) else None))
        elif entry.name == legacy:
            out.append((entry, None))
    return out


def reclaim_temps(path: Path, *, all_writers: bool = False) -> list[Path]:
    """Remove the temporary files of ``path`` left by writers that are gone (a pid that no
    longer runs, or none recorded); with ``all_writers`` (the caller holds a lock that every
    writer takes), every one. Returns the removed files."""
    removed = []
    for file, pid in temp_files(path):
        if all_writers or pid is None or (pid != os.getpid() and not pid_alive(pid)):
            file.unlink(missing_ok=True)
            removed.append(file)
    return removed
