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

Every write goes through :func:`~megatron_hcp.atomic_write.write_atomic` (unique temporary
file, fsync, rename) and calls ``on_step`` first: the fault-injection point of the crash tests.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..atomic_write import Step, fsync_dir, reclaim_temps, write_atomic
from ..bounded_read import InputFileError, read_json
from .registry import PatchError

__all__ = ["DEFAULT_LOCK_TIMEOUT", "JOURNAL_DIR", "LOCK_FILE", "Notify", "recover",
           "run_transaction", "target_lock"]

LOCK_FILE = ".megatron-hcp-patch.lock"
JOURNAL_DIR = ".megatron-hcp-patch.journal"
DEFAULT_LOCK_TIMEOUT = 10.0
_POLL_SECONDS = 0.05
_RECORD = "journal.json"

Notify = Callable[[str], None]
"""Receives the lines a user should see (waiting for the lock, a recovery)."""


def _digest(content: str | None) -> str | None:
    return None if content is None else hashlib.sha256(content.encode("utf-8")).hexdigest()


def _read(file: Path) -> str | None:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


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

    Yields True while the lock is held; with ``read_only_ok`` a directory this process cannot
    write to is read without the lock when no writer holds one (yields False)."""
    path = directory / LOCK_FILE
    deadline = time.monotonic() + timeout
    told = False
    while True:
        writable = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EROFS, errno.EPERM) or not read_only_ok:
                raise PatchError(f"cannot create the lock {path} ({err.strerror}); patching "
                                 "needs write access to the target") from None
            try:  # a writer creates the file: no file, no writer
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                yield False
                return
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
        try:  # the previous holder may have removed the file we locked: lock the new one
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
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
        yield True
    finally:
        if writable:
            path.unlink(missing_ok=True)
        os.close(fd)


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


def _write_journal(root: Path, journal: _Journal, backups: dict[str, str | None],
                   on_step: Step | None) -> None:
    folder = _journal_dir(root)
    _step(on_step, f"create the journal {folder}")
    (folder / "before").mkdir(parents=True)
    fsync_dir(folder.parent)
    for i, entry in enumerate(journal.entries):  # plain writes: no record, no journal yet
        content = backups[entry.path]
        if content is not None:
            copy = folder / "before" / str(i)
            _step(on_step, f"write the journal's copy {copy}")
            with open(copy, "x", encoding="utf-8") as fh:
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
        if copy.exists():
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
        file = root / entry.path
        try:
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
        except OSError as err:
            failed.append(f"{entry.path} ({err})")
    return restored, failed


def recover(root: Path, *, on_step: Step | None = None) -> str | None:
    """Finish what an interrupted transaction on ``root`` left (call under the lock): None when
    there was nothing, else the line saying what was done."""
    folder = _journal_dir(root)
    if not folder.exists():
        return None
    if not (folder / _RECORD).exists():
        _step(on_step, f"remove the journal {folder}")
        shutil.rmtree(folder, ignore_errors=True)
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


def run_transaction(root: Path, changes: dict[str, str | None], operation: str,
                    patches: list[str], *, on_step: Step | None = None) -> None:
    """Write every changed file or none (call under the lock, after :func:`recover`).

    On a failure every file that changed is restored from the journal and verified; the
    error says exactly which files were restored, and which could not be (the journal then
    stays for the next apply, revert or check)."""
    backups = {path: _read(root / path) for path in changes}
    journal = _Journal(operation, tuple(patches),
                       f"pid {os.getpid()} on {socket.gethostname()} at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
                       tuple(_Entry(p, _digest(backups[p]), _digest(c))
                             for p, c in changes.items()))
    try:
        _write_journal(root, journal, backups, on_step)
    except Exception as err:  # noqa: BLE001 - nothing changed yet: drop the partial journal
        shutil.rmtree(_journal_dir(root), ignore_errors=True)
        raise PatchError(f"{operation} failed while writing its journal ({err}); no file was "
                         "changed") from err
    current = None
    try:
        for path, content in changes.items():
            current = path
            file = root / path
            if content is None:
                _step(on_step, f"remove {file}")
                file.unlink(missing_ok=True)
                fsync_dir(file.parent)
            else:
                write_atomic(file, content, on_step=on_step)
        current = None
        wrong = [p for p, c in changes.items() if _read(root / p) != c]
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
