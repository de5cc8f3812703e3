"""Patch transactions survive a crash at any write and a second process (like a package
manager's): a lock per target, a journal written before the first change, recovery by the
next apply, revert or check, messages that say exactly what changed.

Crashes are real: the transaction runs in a forked child whose fault-injection hook
(``on_step``, called before every write) ends the process with ``os._exit`` at write k, for
every k. Concurrency is real too: forked children and CLI subprocesses on one target.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

from megatron_hcp.cli import main as cli_main
from megatron_hcp.patching import PatchError, megatron_core_version
from megatron_hcp.patching.forkpatch import (
    PATCHES_DIR,
    apply_diffs,
    check_diffs,
    read_header,
    revert_diffs,
    series_for,
)
from megatron_hcp.patching.transaction import JOURNAL_DIR, LOCK_FILE, target_lock

INSTALLED = megatron_core_version()
CRASH = 77
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def target(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "pkg")
    return tmp_path / "pkg"


@pytest.fixture
def memory_target(pristine, tmp_path):
    """A target in memory where the machine has a tmpfs (``/dev/shm``), else on disk: the crash
    loops below run ~240 transactions, whose fsyncs on a disk are most of their time, and a
    process crash (``os._exit``) keeps written data either way."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        shutil.copytree(pristine, tmp_path / "pkg")
        yield tmp_path / "pkg"
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="megatron-hcp-patch-") as folder:
        shutil.copytree(pristine, Path(folder) / "pkg")
        yield Path(folder) / "pkg"


def touched_paths() -> list[str]:
    """Every file the installed version's diffs edit or add."""
    paths = set()
    for file in sorted((PATCHES_DIR / f"megatron-core-{INSTALLED}").glob("*.patch")):
        paths |= set(re.findall(r"^diff --git a/(\S+)", read_header(file)["body"], re.M))
    return sorted(paths)


PATHS = touched_paths()


def state(root: Path) -> dict[str, bytes | None]:
    """The content of every file a transaction may touch (None: absent)."""
    return {p: (root / p).read_bytes() if (root / p).is_file() else None for p in PATHS}


def restore(root: Path, files: dict[str, bytes | None]) -> None:
    """Put ``files`` back (the test's own reset between two crashes)."""
    for path, content in files.items():
        if content is None:
            (root / path).unlink(missing_ok=True)
        else:
            (root / path).write_bytes(content)


def leftovers(root: Path) -> list[str]:
    """Journal, lock and temporary files anywhere in the target (names only)."""
    out = []
    for folder, dirs, files in os.walk(root / "megatron"):
        for name in dirs + files:
            if name in (JOURNAL_DIR, LOCK_FILE) or name.endswith(".tmp"):
                out.append(os.path.join(folder, name))
    return out


def in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit code (0: returned, 1: raised)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def crash_at(k: int):
    """An ``on_step`` hook that kills the process (no cleanup at all) before write ``k``."""
    count = itertools.count()

    def on_step(what: str) -> None:
        if next(count) == k:
            os._exit(CRASH)

    return on_step


COMMANDS = {"apply": apply_diffs, "revert": revert_diffs, "check": check_diffs}


@pytest.mark.parametrize("operation", ["apply", "revert"])
def test_a_crash_at_any_write_is_recovered_by_the_next_command(memory_target, operation):
    target = memory_target
    original = state(target)
    apply_diffs(target)
    patched = state(target)
    revert_diffs(target)
    assert state(target) == original and original != patched
    start, goal = (original, patched) if operation == "apply" else (patched, original)
    if operation == "revert":
        apply_diffs(target)
    run = COMMANDS[operation]
    steps: list[str] = []
    run(target, on_step=steps.append)  # the writes of one transaction, in order
    restore(target, start)
    record = max(i for i, s in enumerate(steps) if s.startswith("rename") and "journal.json"
                 in s)
    last_file = max(i for i, s in enumerate(steps) if s.startswith(("rename", "remove "))
                    and JOURNAL_DIR not in s)
    committed = steps.index(next(s for s in steps if s.startswith("remove the journal record")))
    assert 0 < record < last_file < committed < len(steps) - 1
    for k in range(len(steps)):
        assert in_child(lambda k=k: run(target, on_step=crash_at(k))) == CRASH, k
        command = ("apply", "revert", "check")[k % 3]
        notes: list[str] = []
        COMMANDS[command](target, notify=notes.append)
        # what the recovery must have found: the crash came before write k
        if k == 0:
            expected, kind = start, None  # nothing was on disk yet
        elif k <= record:
            expected, kind = start, "removed the unfinished journal"
        elif k <= last_file:
            expected, kind = start, "rolled back an interrupted patch " + operation
        elif k <= committed:
            expected, kind = goal, "completed an interrupted patch " + operation
        else:
            expected, kind = goal, "removed the unfinished journal"
        assert len(notes) == (kind is not None) and (kind is None or notes[0].startswith(kind)
                                                     ), (k, steps[k], notes)
        if kind and kind.startswith("rolled back"):
            changed = sum(s.startswith(("rename", "remove ")) and JOURNAL_DIR not in s
                          for s in steps[:k])
            assert f"restored {changed} file(s)" in notes[0], (k, notes)
        now = state(target)
        if command == "check":
            assert now == expected, (k, steps[k], notes)
        else:
            assert now == (patched if command == "apply" else original), (k, steps[k])
        assert leftovers(target) == [], (k, steps[k])
        restore(target, start)


def test_a_write_failure_restores_exactly_the_files_that_changed(target):
    original = state(target)
    first_write = next(i for i, s in enumerate(record_steps(target))
                       if s.startswith("write") and JOURNAL_DIR not in s)

    def fail_at(k: int, always: str | None = None):
        count = itertools.count()

        def on_step(what: str) -> None:
            if next(count) == k or (always is not None and always in what):
                raise PermissionError(f"[Errno 13] Permission denied: {what}")

        return on_step

    # the first file cannot be written (a read-only file): nothing changed, and nothing is
    # said about restoring it
    with pytest.raises(PatchError) as info:
        apply_diffs(target, on_step=fail_at(first_write))
    assert "no file had been changed" in str(info.value), info.value
    assert "could NOT" not in str(info.value) and "restored" not in str(info.value)
    assert state(target) == original and leftovers(target) == []
    # the 5th file fails after 4 were written: those 4, by name, are restored
    fifth = [i for i, s in enumerate(record_steps(target))
             if s.startswith("write") and JOURNAL_DIR not in s][4]
    with pytest.raises(PatchError, match=r"rolled back: restored 4 file\(s\) it had changed"
                       ) as info:
        apply_diffs(target, on_step=fail_at(fifth))
    listed = re.search(r"it had changed \(([^)]*)\)", str(info.value)).group(1).split(", ")
    assert len(listed) == 4 and set(listed) <= set(PATHS), info.value
    assert state(target) == original and leftovers(target) == []
    # the 5th file fails and restoring the 2nd fails too: the 2nd is named, the journal stays
    # and the next command finishes the rollback
    steps = record_steps(target)
    second = [s for s in steps if s.startswith("write") and JOURNAL_DIR not in s][1]
    victim = second.split(" for ")[1]
    count = itertools.count()

    def disk_trouble(what: str) -> None:
        n = next(count)
        if n == fifth or (n > fifth and what == second):
            raise OSError("disk gone")

    with pytest.raises(PatchError, match="could NOT be restored") as info:
        apply_diffs(target, on_step=disk_trouble)
    assert str(Path(victim).relative_to(target)) in str(info.value).split("could NOT")[1]
    assert "restored 3 file(s)" in str(info.value)
    assert state(target) != original and (target / "megatron" / JOURNAL_DIR).is_dir()
    notes: list[str] = []
    check_diffs(target, notify=notes.append)
    assert notes and notes[0].startswith("rolled back an interrupted patch apply"), notes
    assert "restored 1 file(s)" in notes[0]
    assert state(target) == original and leftovers(target) == []


def record_steps(target: Path) -> list[str]:
    """The writes of an apply on ``target`` (applied, then reverted again)."""
    steps: list[str] = []
    apply_diffs(target, on_step=steps.append)
    revert_diffs(target)
    return steps


def test_concurrent_applies_and_reverts_serialize(target, tmp_path):
    original = state(target)
    for operation in ("apply", "revert"):
        read, write = os.pipe()
        pids = []
        for i in range(4):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child: wait for the start signal, then race
                os.close(write)
                os.read(read, 1)
                try:
                    done = COMMANDS[operation](target, lock_timeout=60)
                    out = {"done": done}
                except Exception as err:  # noqa: BLE001
                    out = {"error": str(err)}
                (tmp_path / f"{operation}{i}.json").write_text(json.dumps(out))
                os._exit(0)
            pids.append(pid)
        os.close(read)
        os.close(write)  # all children start at once
        for pid in pids:
            os.waitpid(pid, 0)
        results = [json.loads((tmp_path / f"{operation}{i}.json").read_text())
                   for i in range(4)]
        assert all("done" in r for r in results), results
        counts = sorted(len(r["done"]) for r in results)
        assert counts == [0, 0, 0, len(series_for(INSTALLED))], results
        if operation == "apply":
            assert {s.state for s in check_diffs(target)[1] if s.has_diff} == {"applied"}
        assert leftovers(target) == []
    assert state(target) == original


def cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "megatron_hcp.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


@pytest.mark.multirank
def test_a_second_process_waits_then_refuses_naming_the_holder(target):
    original = state(target)
    with target_lock(target / "megatron"):
        proc = cli("patch", "apply", "--target", str(target), "--lock-timeout", "0.5")
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (out, err)
        lines = err.strip().splitlines()
        assert lines[0].startswith("megatron-hcp patch: waiting up to 0.5 s for the lock"), err
        assert lines[-1].startswith("refused:") and len(lines) == 2, err
        assert f"locked by pid {os.getpid()} on {socket.gethostname()}" in lines[-1], err
        assert "waited 0.5 s" in lines[-1]
        assert state(target) == original
        # a waiting process goes ahead as soon as the holder is done
        proc = cli("patch", "apply", "--target", str(target), "--lock-timeout", "120")
        assert proc.stderr.readline().startswith("megatron-hcp patch: waiting up to 120 s")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.startswith(
        f"applied {len(series_for(INSTALLED))} patch(es)"), (out, err)
    assert leftovers(target) == []


@pytest.mark.multirank
def test_ctrl_c_while_waiting_is_one_line_and_exit_130(target):
    with target_lock(target / "megatron"):
        # a terminal's child takes Ctrl-C; a CI job started in the background may have SIGINT
        # ignored, which every child inherits (Python then installs no KeyboardInterrupt)
        proc = cli("patch", "revert", "--target", str(target), "--lock-timeout", "120",
                   start_new_session=True,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert proc.stderr.readline().startswith("megatron-hcp patch: waiting")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "megatron-hcp: interrupted", err
    assert leftovers(target) == []


def test_a_journal_that_leaves_the_target_is_refused(target):
    folder = target / "megatron" / JOURNAL_DIR
    (folder / "before").mkdir(parents=True)
    (folder / "journal.json").write_text(json.dumps({
        "operation": "patch apply", "patches": ["x"], "started": "pid 1",
        "files": [{"path": "../outside.py", "before": None, "after": "0" * 64}]}))
    with pytest.raises(PatchError, match="'../outside.py', which is not a file of the target"):
        check_diffs(target)
    (folder / "journal.json").write_text("[" * 100000)
    with pytest.raises(PatchError, match="unreadable .*deeper than the limit of 64"):
        apply_diffs(target)


# ---------------------------------------------------------------- no link out of the target
def run_cli(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``megatron-hcp patch ...`` run in this process."""
    code = cli_main(["patch", *args])
    return code, capsys.readouterr().err


def refused(code: int, err: str, *words: str) -> None:
    """Exit 2 with one line (no traceback) that says ``words``."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("refused: "), (code, err)
    assert all(w in lines[0] for w in words), err


def tree(folder: Path) -> dict[str, bytes | None]:
    """Everything under ``folder`` (directories as None), without following links."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("command", ["check", "apply", "revert"])
def test_a_lock_file_that_is_a_link_is_refused_and_nothing_outside_is_written(
        target, tmp_path, capsys, command):
    lock = target / "megatron" / LOCK_FILE
    outside = tmp_path / "outside.txt"
    outside.write_text("not the lock's\n")
    original = state(target)
    for how in ("symlink", "dangling symlink", "hard link"):
        if how == "hard link":
            os.link(outside, lock)
        else:
            lock.symlink_to(outside if how == "symlink" else tmp_path / "created-outside")
        code, err = run_cli(capsys, command, "--target", str(target))
        assert outside.read_text() == "not the lock's\n", how  # not overwritten
        assert not (tmp_path / "created-outside").exists(), how  # not created through it
        assert os.path.lexists(lock), how  # the link is the user's to remove
        refused(code, err, LOCK_FILE, "link")
        lock.unlink()
    assert state(target) == original


def test_a_journal_that_is_a_link_is_refused_and_nothing_is_written_outside(
        target, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = target / "megatron" / JOURNAL_DIR
    original = state(target)
    folder.symlink_to(outside)
    for command in ("apply", "check", "revert"):
        code, err = run_cli(capsys, command, "--target", str(target))
        assert tree(outside) == {} and state(target) == original, command
        assert folder.is_symlink(), command
        refused(code, err, JOURNAL_DIR, "symbolic link")


def test_a_journal_holding_a_link_is_refused_and_nothing_outside_is_removed(
        target, tmp_path, capsys):
    # a journal whose copies folder is a link: a recovery would remove the copies and stray
    # temporary files in the folder it points to
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = target / "megatron" / JOURNAL_DIR
    original = state(target)
    info = "megatron/core/package_info.py"
    digest = hashlib.sha256((target / info).read_bytes()).hexdigest()
    folder.mkdir()
    (folder / "journal.json").write_text(json.dumps({
        "operation": "patch apply", "patches": ["x"], "started": "pid 1",
        "files": [{"path": info, "before": "0" * 64, "after": digest}]}))
    (outside / "0").write_text("a file of the user's\n")
    (outside / "0.1.abc.tmp").write_text("another\n")
    (folder / "before").symlink_to(outside)
    kept = tree(outside)
    for command in ("check", "apply"):
        code, err = run_cli(capsys, command, "--target", str(target))
        assert tree(outside) == kept and state(target) == original, command
        refused(code, err, "before", "symbolic link")


@pytest.mark.parametrize("link", ["directory", "file"])
def test_a_target_path_through_a_link_is_refused_and_its_outside_copy_kept(
        target, tmp_path, capsys, link):
    # a diff edits megatron/core/transformer/attention.py: the file, or its folder, is a link
    # to a copy outside the target
    folder = target / "megatron" / "core" / "transformer"
    outside = tmp_path / "outside"
    shutil.copytree(folder, outside)
    moved = folder if link == "directory" else folder / "attention.py"
    shutil.rmtree(moved) if link == "directory" else moved.unlink()
    moved.symlink_to(outside if link == "directory" else outside / "attention.py")
    kept = tree(outside)
    for command in ("apply", "check", "revert"):
        code, err = run_cli(capsys, command, "--target", str(target))
        assert tree(outside) == kept, command
        assert moved.is_symlink() and leftovers(target) == [], command
        refused(code, err, str(moved), "symbolic link")


def test_a_journal_entry_naming_a_directory_is_a_one_line_refusal(target, capsys):
    folder = target / "megatron" / JOURNAL_DIR
    (folder / "before").mkdir(parents=True)
    (folder / "journal.json").write_text(json.dumps({
        "operation": "patch apply", "patches": ["x"], "started": "pid 1",
        "files": [{"path": "megatron/core", "before": None, "after": "0" * 64}]}))
    original = state(target)
    for command in ("check", "apply", "revert"):
        code, err = run_cli(capsys, command, "--target", str(target))
        refused(code, err, "megatron/core", "is a directory", JOURNAL_DIR)
    assert state(target) == original and (folder / "journal.json").is_file()


# ---------------------------------------------------------------- a read-only target
NOBODY = 65534


def as_reader(fn) -> tuple[int | None, str]:
    """(result, stderr) of ``fn`` in a forked child that can read but not write the target:
    as root, the child runs as ``nobody``; else the caller made the target read-only."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(read)
        out: dict = {"rc": None}
        err = io.StringIO()
        try:
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                out["rc"] = fn()
        except BaseException:  # noqa: BLE001 - a traceback is what the test must not see
            err.write(traceback.format_exc())
        out["err"] = err.getvalue()
        with os.fdopen(write, "w") as fh:
            fh.write(json.dumps(out))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        out = json.loads(fh.read())
    os.waitpid(pid, 0)
    return out["rc"], out["err"]


def writable(root: Path, on: bool) -> None:
    """Make every directory of ``root`` writable or not (a non-root user's read-only tree)."""
    for folder, _, _ in os.walk(root):
        os.chmod(folder, 0o755 if on else 0o555)


@pytest.mark.parametrize("lock_mode", [0o644, 0o666])
def test_a_read_only_target_holding_an_interrupted_transaction_is_refused_in_one_line(
        pristine, lock_mode):
    # outside pytest's private tmp folder, which another user cannot enter
    base = Path(tempfile.mkdtemp(prefix="megatron-hcp-ro-"))
    try:
        base.chmod(0o755)
        target = base / "pkg"
        shutil.copytree(pristine, target)
        target.chmod(0o755)  # copied from pytest's private folder
        original = state(target)
        cli_main(["patch", "check", "--target", str(target)])  # imports what the child needs
        steps = record_steps(target)
        third = [i for i, s in enumerate(steps) if s.startswith("rename") and JOURNAL_DIR
                 not in s][2]
        assert in_child(lambda: apply_diffs(target, on_step=crash_at(third))) == CRASH
        lock = target / "megatron" / LOCK_FILE
        assert lock.is_file() and (target / "megatron" / JOURNAL_DIR).is_dir()  # as kill -9
        lock.chmod(lock_mode)  # 0o666: the lock opens for writing, the folders do not
        interrupted = state(target)
        assert interrupted != original
        if os.geteuid() != 0:
            writable(target, False)
        try:
            for command in ("check", "apply", "revert"):
                code, err = as_reader(lambda c=command: cli_main(
                    ["patch", c, "--target", str(target)]))
                refused(code, err, str(target))
                assert state(target) == interrupted, command
        finally:
            writable(target, True)
        notes: list[str] = []
        check_diffs(target, notify=notes.append)  # a user who can write finishes it
        assert notes[0].startswith("rolled back an interrupted patch apply"), notes
        assert state(target) == original and leftovers(target) == []
    finally:
        shutil.rmtree(base)
