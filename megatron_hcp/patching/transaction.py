"""File transactions on a patch target, like a package manager's: a lock, a journal, recovery.

* **Lock** (:func:`target_lock`): ``megatron/.megatron-hcp-patch.lock``, an exclusive
  ``flock`` held for a whole ``apply``, ``revert`` or ``check``. A second process waits up to
  ``timeout`` seconds (saying so once), then refuses, naming the holder (pid, host, command,
  since when). The kernel drops the lock when its holder dies, ``kill -9`` included; the
  holder removes the file when done.
* **Journal** (:func:`run_transaction`): ``megatron/.megatron-hcp-patch.journal/`` is written
  before the first file changes: a copy of every file's content before the transaction
  (``before/<i>``), then ``journal.json`` (the operation, the patches, each file with the
  sha256 of its content before and after). ``journal.json`` is written last and removed
  first, after every file was written and read back: a journal without it recorded no change
  in progress.
* **Recovery** (:func:`recover`, run under the lock before every apply, revert and check): an
  interrupted transaction is **completed** when every file already holds its new content, and
  **rolled back** from the copies otherwise; every file is verified by digest, stray temporary
  files are removed, and the message says which it was and which files changed. A file that
  holds neither its old nor its new content (edited since) stops the recovery, naming it.

Every write goes through :func:`~megatron_hcp.files.atomic_write.write_atomic` (unique temporary
file, fsync, rename) and calls ``on_step`` first: the fault-injection point of the crash tests.

**Inside the target, bytes as they are**: no link is followed. The lock file is opened with
``O_NOFOLLOW`` (and must be a regular file with one name), the journal and its parts must be
real directories and files (``lstat``), and every file a transaction reads, writes or removes
is proven inside the target by :func:`target_path` (each component a real directory, the file
a regular one): a link is refused by name, changing nothing. Files are read and written as
bytes, so a restored file is byte-identical (line endings included).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..files.atomic_write import Step, fsync_dir, reclaim_temps, write_atomic
from ..files.bounded_read import InputFileError, read_json
from .registry import PatchError

__all__ = ["DEFAULT_LOCK_TIMEOUT", "JOURNAL_DIR", "LOCK_FILE", "Notify", "journal_present",
           "read_target", "recover", "run_transaction", "target_lock", "target_path"]

LOCK_FILE = ".megatron-hcp-patch.lock"
JOURNAL_DIR = ".megatron-hcp-patch.journal"
DEFAULT_LOCK_TIMEOUT = 10.0
_POLL_SECONDS = 0.05
_RECORD = "journal.json"
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link; never block (FIFO)

Notify = Callable[[str], None]
"""Receives the lines a user should see (waiting for the lock, a recovery)."""


def _digest(content: bytes | None) -> str | None:
    return None if content is None else hashlib.sha256(content).hexdigest()


def _read(file: Path) -> bytes | None:
    """The bytes of the regular file ``file`` (None: absent), never through a link."""
    try:
        fd = os.open(file, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(file))
        return fh.read()


def _why(err: OSError) -> str:
    return f"{err.strerror}: {err.filename}" if err.strerror and err.filename else str(err)


def _refusal(what: str, path: Path, rule: str, fix: str) -> PatchError:
    """The one-line refusal: what, its path, the rule it breaks, the fix."""
    return PatchError(f"{what} {str(path)!r}: {rule}; {fix}")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a directory" if stat.S_ISDIR(mode) else (
        "a regular file" if stat.S_ISREG(mode) else "a FIFO, socket or device")


_OWN_FIX = "remove it (the patch engine creates its own) and run this again"


def _link_refusal(what: str, path: Path, fix: str = _OWN_FIX) -> PatchError:
    try:
        to = os.readlink(path)
    except OSError:
        to = "?"
    return _refusal(what, path, f"is a symbolic link (to {to!r}), and patching follows no "
                    "link: every file it writes or removes must lie inside the target", fix)


def _lmode(path: Path) -> int | None:
    """``lstat`` mode of ``path`` (None: absent); the link itself, never what it names."""
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


def _require(what: str, path: Path, want: Callable[[int], bool], wanted: str,
             fix: str = _OWN_FIX) -> bool:
    """True when ``path`` exists and is ``wanted`` (checked without following a link); False
    when absent; a link or anything else is refused by name."""
    mode = _lmode(path)
    if mode is None:
        return False
    if stat.S_ISLNK(mode):
        raise _link_refusal(what, path, fix)
    if not want(mode):
        raise _refusal(what, path, f"is {_kind(mode)}, not {wanted}", fix)
    return True


_FILE_FIX = ("restore the target (e.g. reinstall megatron-core), with regular files and "
             "directories in place of links, and run this again")


def target_path(root: Path, rel: str, *, fix: str = _FILE_FIX) -> Path:
    """``root / rel``, proven inside the target without following a link: ``rel`` is relative,
    under ``megatron/``, without ``..``; every component that exists below ``root`` is a real
    directory and the file itself (if it exists) a regular file. Else a named PatchError."""
    parts = Path(rel).parts
    if Path(rel).is_absolute() or not parts or parts[0] != "megatron" or ".." in parts:
        raise _refusal("the patch target path", root / rel,
                       "is not a file of the target (a path under megatron/)", fix)
    path = root
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = _lmode(path)
        except OSError as err:
            raise _refusal("the patch target path", path,
                           f"cannot be checked ({err.strerror})", fix) from None
        if mode is None:  # neither it nor anything below exists
            return root.joinpath(*parts)
        if stat.S_ISLNK(mode):
            raise _link_refusal("the patch target path", path, "replace the link with what it "
                                "points to (or give that directory as --target) and run "
                                "this again")
        wanted = "a directory" if i < len(parts) - 1 else "a regular file"
        if _kind(mode) != wanted:
            raise _refusal("the patch target path", path, f"is {_kind(mode)}, not {wanted}",
                           fix)
    return path


def read_target(root: Path, rel: str) -> bytes | None:
    """The bytes of the target's file ``rel`` (None: absent), checked by :func:`target_path`."""
    path = target_path(root, rel)
    try:
        return _read(path)
    except OSError as err:
        raise _refusal("the patch target file", path, f"cannot be read ({err.strerror})",
                       "give a target this user can read") from None


def _step(on_step: Step | None, what: str) -> None:
    if on_step is not None:
        on_step(what)


# ------------------------------------------------------------------------------- the lock
def _holder_text(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return (f"pid {int(info['pid'])} on {info['host']} ({info['command']}, since "
                f"{info['since']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not recorded which yet)"


@contextmanager
def target_lock(directory: Path, *, timeout: float = DEFAULT_LOCK_TIMEOUT,
                notify: Notify | None = None, read_only_ok: bool = False) -> Iterator[bool]:
    """Hold the exclusive lock of the patch target ``directory`` (its ``megatron`` folder).

    Yields True while the lock is held for writing. With ``read_only_ok`` a directory this
    process cannot write to yields False - read only, nothing may be written - once no writer
    holds the lock. The directory and the lock file are never links (refused by name); the
    lock file is opened with ``O_NOFOLLOW`` and must be a regular file with one name."""
    _require("the patch target directory", directory, stat.S_ISDIR, "a directory",
             "give the directory it points to as --target")
    path = directory / LOCK_FILE
    deadline = time.monotonic() + timeout
    told = False
    while True:
        writable = True
        try:
            fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EROFS, errno.EPERM) or not read_only_ok:
                raise PatchError(f"cannot create the lock {path} ({err.strerror}); patching "
                                 "needs write access to the target") from None
            try:  # a writer creates the file: no file, no writer
                fd = _open_lock(path, os.O_RDONLY)
            except FileNotFoundError:
                yield False
                return
            except OSError as err:
                raise PatchError(f"cannot open the lock {path} ({err.strerror}); run this "
                                 "as a user who can read the target") from None
            writable = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise PatchError(f"{directory.parent} is locked by {holder}: another patch "
                                 f"apply, revert or check is running there (waited "
                                 f"{timeout:g} s); wait for it to finish and run this again"
                                 ) from None
            if notify is not None and not told:
                notify(f"waiting up to {timeout:g} s for the lock on {directory.parent}, "
                       f"held by {holder}")
                told = True
            time.sleep(_POLL_SECONDS)
            continue
        own = os.fstat(fd)
        try:  # the previous holder may have removed the file we locked: lock the new one
            now = os.lstat(path)
            same = (now.st_ino, now.st_dev) == (own.st_ino, own.st_dev)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        if writable:
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "command": " ".join(sys.argv)[:200] or "python",
                    "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        yield writable
    finally:
        if writable:
            try:  # our own file only, by its name inside the target
                now = os.lstat(path)
                if (now.st_ino, now.st_dev) == (own.st_ino, own.st_dev):
                    os.unlink(path)
            except OSError:
                pass  # a lock file left behind is harmless: the next holder reuses it
        os.close(fd)


def _open_lock(path: Path, flags: int) -> int:
    """Open the lock file without following a link; refuse a link, anything but a regular
    file, and a file with another name (a hard link to a file elsewhere)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK) and stat.S_ISLNK(_lmode(path) or 0):
            raise _link_refusal("the patch lock", path) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        rule = (f"has {info.st_nlink} names (a hard link: writing it would change a file "
                "elsewhere)" if stat.S_ISREG(info.st_mode)
                else f"is {_kind(info.st_mode)}, not a regular file")
        raise _refusal("the patch lock", path, rule, _OWN_FIX)
    return fd


# ------------------------------------------------------------------------------- the journal
@dataclass(frozen=True)
class _Entry:
    path: str  # relative to the target root
    before: str | None  # sha256 of the content before (None: the file did not exist)
    after: str | None  # sha256 of the content after (None: the transaction removes it)


@dataclass(frozen=True)
class _Journal:
    operation: str  # "patch apply" | "patch revert"
    patches: tuple[str, ...]
    started: str  # who and when, for the messages
    entries: tuple[_Entry, ...]


def _journal_dir(root: Path) -> Path:
    return root / "megatron" / JOURNAL_DIR


def journal_present(root: Path) -> bool:
    """True when the target holds a journal (a real directory; a link there is refused)."""
    folder = _journal_dir(root)
    if not _require("the patch journal", folder, stat.S_ISDIR, "a directory"):
        return False
    _require("the patch journal's copies", folder / "before", stat.S_ISDIR, "a directory")
    _require("the patch journal's record", folder / _RECORD, stat.S_ISREG, "a regular file")
    return True


def _write_journal(folder: Path, journal: _Journal, backups: dict[str, bytes | None],
                   on_step: Step | None) -> None:
    """Fill the journal folder this transaction just created (a real directory)."""
    os.mkdir(folder / "before")
    fsync_dir(folder.parent)
    for i, entry in enumerate(journal.entries):  # plain writes: no record, no journal yet
        content = backups[entry.path]
        if content is not None:
            copy = folder / "before" / str(i)
            _step(on_step, f"write the journal's copy {copy}")
            with open(copy, "xb") as fh:  # exclusive: never through an existing name
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
    fsync_dir(folder / "before")
    record = {"operation": journal.operation, "patches": list(journal.patches),
              "started": journal.started,
              "files": [{"path": e.path, "before": e.before, "after": e.after}
                        for e in journal.entries]}
    write_atomic(folder / _RECORD, json.dumps(record, indent=1), on_step=on_step)


def _remove_journal(root: Path, journal: _Journal, on_step: Step | None) -> None:
    """Copies first, the record after them (the commit), then the folder."""
    folder = _journal_dir(root)
    for i, _ in enumerate(journal.entries):
        copy = folder / "before" / str(i)
        if os.path.lexists(copy):
            _step(on_step, f"remove the journal's copy {copy}")
            copy.unlink()
    _step(on_step, f"remove the journal record {folder / _RECORD}")
    (folder / _RECORD).unlink(missing_ok=True)
    _step(on_step, f"remove the journal {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    fsync_dir(folder.parent)


def _load_journal(root: Path) -> _Journal:
    folder = _journal_dir(root)
    try:
        raw = read_json(folder / _RECORD, "patch journal", max_bytes=1 << 20)
        files = raw["files"]
        entries = tuple(_Entry(str(f["path"]), f["before"], f["after"]) for f in files)
        journal = _Journal(str(raw["operation"]), tuple(map(str, raw["patches"])),
                           str(raw["started"]), entries)
    except (InputFileError, KeyError, TypeError) as err:
        raise PatchError(f"the journal {folder} of an interrupted transaction is unreadable "
                         f"({err}); restore the target (e.g. reinstall megatron-core), then "
                         "remove that folder") from None
    for entry in entries:
        rel = Path(entry.path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0] != "megatron":
            raise PatchError(f"the journal {folder} names {entry.path!r}, which is not a file "
                             "of the target; remove that folder and reinstall megatron-core")
        target_path(root, entry.path, fix=f"the journal {folder} names it: restore the target "
                    "(e.g. reinstall megatron-core), then remove that folder")
        for digest in (entry.before, entry.after):
            if digest is not None and (not isinstance(digest, str) or len(digest) != 64):
                raise PatchError(f"the journal {folder} has a malformed digest for "
                                 f"{entry.path}; remove that folder and reinstall megatron-core")
    return journal


# ------------------------------------------------------------------------------- transactions
def _listing(paths: list[str], limit: int = 6) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _roll_back(root: Path, journal: _Journal, on_step: Step | None) -> tuple[list[str], list[str]]:
    """Restore every file that no longer holds its content from before: (restored, failed
    with reason). Files that were never changed are not touched."""
    folder = _journal_dir(root)
    restored, failed = [], []
    for i, entry in enumerate(journal.entries):
        try:
            file = target_path(root, entry.path)
            if _digest(_read(file)) == entry.before:
                continue
            if entry.before is None:
                _step(on_step, f"remove {file}")
                file.unlink()
                fsync_dir(file.parent)
            else:
                copy = _read(folder / "before" / str(i))
                if _digest(copy) != entry.before:
                    raise OSError(f"the journal's copy {folder / 'before' / str(i)} is missing "
                                  "or damaged")
                write_atomic(file, copy, on_step=on_step)
            if _digest(_read(file)) != entry.before:
                raise OSError("differs from its content before the transaction after "
                              "restoring")
            restored.append(entry.path)
        except (OSError, PatchError) as err:
            failed.append(f"{entry.path} ({err})")
    return restored, failed


def recover(root: Path, *, on_step: Step | None = None) -> str | None:
    """Finish what an interrupted transaction on ``root`` left (call under the lock): None when
    there was nothing, else the line saying what was done. A journal that is a link (or holds
    one), or that cannot be finished here (e.g. a read-only target), is a named PatchError."""
    if not journal_present(root):
        return None
    folder = _journal_dir(root)
    try:
        return _finish(root, folder, on_step)
    except OSError as err:
        raise PatchError(f"the patch journal {str(folder)!r}: cannot finish the interrupted "
                         f"transaction it records ({_why(err)}); run patch check as a user who "
                         "can write to the target") from None


def _finish(root: Path, folder: Path, on_step: Step | None) -> str:
    if _lmode(folder / _RECORD) is None:
        _step(on_step, f"remove the journal {folder}")
        shutil.rmtree(folder)
        return (f"removed the unfinished journal {folder} of an interrupted transaction: it had "
                "not started changing files or had already finished, so no file needed "
                "restoring")
    journal = _load_journal(root)
    for entry in journal.entries:
        reclaim_temps(root / entry.path, all_writers=True)
    for file in (folder / _RECORD, *(folder / "before").glob("*")):
        reclaim_temps(file, all_writers=True)
    what = f"{journal.operation} of {journal.started}"
    now = {e.path: _digest(_read(root / e.path)) for e in journal.entries}
    foreign = [e.path for e in journal.entries if now[e.path] not in (e.before, e.after)]
    if foreign:
        raise PatchError(f"an interrupted {what} left {_listing(foreign)} with content that is "
                         "neither before nor after it (edited since?); the journal "
                         f"{folder} keeps their content from before: restore the files "
                         "(e.g. reinstall megatron-core), then remove that folder")
    if all(now[e.path] == e.after for e in journal.entries):
        _remove_journal(root, journal, on_step)
        return (f"completed an interrupted {what}: all {len(journal.entries)} file(s) already "
                "held their new content (verified by digest); nothing was rewritten")
    restored, failed = _roll_back(root, journal, on_step)
    if failed:
        raise PatchError(f"rolling back an interrupted {what} failed for {_listing(failed)}; "
                         f"the journal {folder} keeps their content from before; fix the "
                         "cause and run patch check again")
    _remove_journal(root, journal, on_step)
    untouched = len(journal.entries) - len(restored)
    return (f"rolled back an interrupted {what} ({', '.join(journal.patches)}): restored "
            f"{len(restored)} file(s) to their content before it ({_listing(restored)}), "
            f"verified by digest; {untouched} file(s) had not been changed")


def run_transaction(root: Path, changes: dict[str, bytes | None], operation: str,
                    patches: list[str], *, on_step: Step | None = None) -> None:
    """Write every changed file (its new bytes; None removes it) or none (call under the lock,
    after :func:`recover`). Every path is proven inside the target first (:func:`target_path`).

    On a failure every file that changed is restored from the journal and verified; the
    error says exactly which files were restored, and which could not be (the journal then
    stays for the next apply, revert or check)."""
    files = {path: target_path(root, path) for path in changes}
    try:
        backups = {path: _read(files[path]) for path in changes}
    except OSError as err:
        raise PatchError(f"{operation} cannot read a file it changes ({_why(err)}); no file "
                         "was changed") from None
    journal = _Journal(operation, tuple(patches),
                       f"pid {os.getpid()} on {socket.gethostname()} at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
                       tuple(_Entry(p, _digest(backups[p]), _digest(c))
                             for p, c in changes.items()))
    folder = _journal_dir(root)
    try:
        _step(on_step, f"create the journal {folder}")
        os.mkdir(folder)  # never through a link; recover() left no journal
    except Exception as err:  # noqa: BLE001 - nothing created, nothing changed
        raise PatchError(f"{operation} failed while creating its journal {folder} ({err}); no "
                         "file was changed") from err
    try:
        _write_journal(folder, journal, backups, on_step)
    except Exception as err:  # noqa: BLE001 - nothing changed yet: drop the partial journal
        shutil.rmtree(folder, ignore_errors=True)
        raise PatchError(f"{operation} failed while writing its journal ({err}); no file was "
                         "changed") from err
    current = None
    try:
        for path, content in changes.items():
            current = path
            file = files[path]
            if content is None:
                _step(on_step, f"remove {file}")
                file.unlink(missing_ok=True)
                fsync_dir(file.parent)
            else:
                write_atomic(file, content, on_step=on_step)
        current = None
        wrong = [p for p, c in changes.items() if _read(files[p]) != c]
        if wrong:
            raise OSError(f"{_listing(wrong)} do not read back as written")
    except Exception as err:  # noqa: BLE001 - roll back whatever failed
        where = f" at {current}" if current else ""
        restored, failed = _roll_back(root, journal, on_step)
        if failed:
            raise PatchError(
                f"{operation} failed{where} ({err}); restored {len(restored)} file(s) "
                f"({_listing(restored) or 'none'}) but these could NOT be restored: "
                f"{_listing(failed)}; the journal {_journal_dir(root)} keeps their content "
                "from before, and the next patch apply, revert or check retries") from err
        _remove_journal(root, journal, on_step)
        if restored:
            raise PatchError(f"{operation} failed{where} ({err}); rolled back: restored "
                             f"{len(restored)} file(s) it had changed ({_listing(restored)}), "
                             "verified byte for byte; no other file had been changed") from err
        raise PatchError(f"{operation} failed{where} ({err}); no file had been changed") from err
    _remove_journal(root, journal, on_step)
