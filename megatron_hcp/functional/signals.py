"""A run ends with the process that runs it: nothing of it is left training.

SIGTERM (what Slurm, Kubernetes or a CI time-out send before their SIGKILL), SIGHUP (the
terminal went away) and SIGINT (Ctrl-C) reach the process that started the run, and often that
process alone: torchrun runs in a process group of its own, and each of its ranks in another.
While :func:`raising_signals` is active (:func:`~.harness.run_recipe` enters it for the run;
the old handlers come back after), SIGTERM and SIGHUP raise :class:`Terminated` and SIGINT
raises ``KeyboardInterrupt``, as it always does. The launcher's code then calls
:func:`end_processes`: the same signal to the launcher's process group and to every process
group of what it started, :data:`GRACE_S` seconds for them to exit, then SIGKILL. The exception
unwinds through the run's ``TemporaryDirectory`` blocks, which remove them; the command line
exits 128 + the signal's number. What a launcher started is found in ``/proc`` (Linux): its
descendants and the members of their process groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FORWARDED", "GRACE_S", "Terminated", "end_processes", "raising_signals",
           "signal_of"]

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 10.0  # within the 30 s that Slurm (KillWait) and Kubernetes give before SIGKILL
_KILLED_WAIT_S = 5.0  # how long SIGKILLed processes may take to go

_depth = 0  # nesting of raising_signals (only the outermost installs handlers)


class Terminated(BaseException):
    """SIGTERM or SIGHUP reached this process during a run. A BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


def signal_of(exc: BaseException) -> int:
    """The signal to pass on to a run that ``exc`` ends: its own (Ctrl-C: SIGINT), else
    SIGTERM (an error of this process, such as a closed output pipe)."""
    if isinstance(exc, Terminated):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return signal.SIGTERM


@contextlib.contextmanager
def raising_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Terminated`, SIGINT ``KeyboardInterrupt``, within the
    block; a signal that is ignored (``nohup``, a background job) stays ignored. Only the first
    signal raises: later ones, while the run ends, are dropped. Outside the main thread (which
    alone receives signals) and inside an active block this does nothing."""
    global _depth
    if _depth or threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:  # the run is already ending on the first one
            return
        received.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    old = {}
    for sig in FORWARDED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, previous in old.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)


def _stat(pid: int) -> tuple[int, int, str, int] | None:
    """``(parent pid, process group, state, start time)`` of a process from ``/proc``, or None
    when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[2]), fields[0], int(fields[19])


def _running(pid: int, start: int) -> bool:
    """The process ``pid`` that started at ``start`` still runs (not a zombie, not reused)."""
    stat = _stat(pid)
    return stat is not None and stat[3] == start and stat[2] not in ("Z", "X")


class _RunProcesses:
    """A launcher and everything it started: its descendants and the members of their process
    groups (a rank's child stays in the rank's group after the rank is gone)."""

    def __init__(self, leader: int) -> None:
        self.leader = leader
        self.pids: dict[int, tuple[int, int]] = {}  # pid -> (start time, process group)
        self.groups: set[int] = set()
        self.own_group = os.getpgrp()

    def refresh(self) -> None:
        """Record what runs now: the leader's descendants and their groups' members."""
        table = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                    table[int(entry.name)] = stat
        if self.leader in table:
            self.pids.setdefault(self.leader, (table[self.leader][3], table[self.leader][1]))
        grew = True
        while grew:  # descendants, however deep, and the members of their groups
            grew = False
            for pid, (parent, group, state, start) in table.items():
                if pid in self.pids or pid == os.getpid() or state in ("Z", "X"):
                    continue
                if parent in self.pids or group in self.groups:
                    self.pids[pid], grew = (start, group), True
            self.groups |= {group for _, group in self.pids.values()} - {self.own_group}

    def running(self) -> bool:
        return any(_running(pid, start) for pid, (start, _) in self.pids.items())

    def send(self, signum: int) -> None:
        """``signum`` to each recorded process group (never this process's own), and to each
        recorded process outside them that still runs: each process gets it once."""
        for group in sorted(self.groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signum)
        for pid, (start, group) in self.pids.items():
            if group not in self.groups and _running(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)


def end_processes(leader: int, signum: int, grace: float = GRACE_S) -> bool:
    """End the launcher ``leader`` and everything it started: ``signum`` to its process group
    and to every process group of its descendants, ``grace`` seconds for them to exit, then
    SIGKILL to those left. Returns True when they exited within ``grace``."""
    run = _RunProcesses(leader)
    run.refresh()
    run.send(signum)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        run.refresh()  # what started meanwhile
        if not run.running():
            return True
        time.sleep(0.1)
    run.refresh()
    run.send(signal.SIGKILL)
    deadline = time.monotonic() + _KILLED_WAIT_S
    while run.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    return False
