"""The ``forkserver`` launcher of a recipe run: torchrun's job on one CPU node, with the ranks
forked from a server that has already imported torch and megatron-core.

torchrun starts each rank as a fresh interpreter, and importing torch and megatron-core costs
several CPU-seconds per rank; on a small CPU machine that is most of a short recipe's time. Here the
ranks are forked from :mod:`multiprocessing`'s forkserver (shared by every world of this process,
see :mod:`megatron_hcp.harness.local_world`), so each run still gets fresh processes but the imports
are paid once per process. Each rank sees what torchrun would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a store this process owns) and runs the same
``main(argv)`` of the worker module; its output goes to a log that the caller reads with torchrun's
``[rankN]:`` prefixes. The first rank to fail ends the others, as torchrun does; Ctrl-C, SIGTERM or
SIGHUP reaching this process reach the ranks too (:mod:`.signals`). CPU (gloo) runs on one node
only: a forked process cannot initialize CUDA.

The ranks of one run are forked by a *zygote*, itself forked from the forkserver: it runs the
worker module's optional ``prefork(argv)`` once (work every rank would repeat, such as Bridge's
imports, which cost 15 CPU-seconds per rank), then forks the ranks and watches them.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import multiprocessing.util
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..harness.local_world import PRELOAD, environment
from .signals import end_processes, signal_of

__all__ = ["run_forked"]

_GRACE_S = 5.0  # how long the other ranks may finish after one failed


def _new_lines(log: Path, start: int = 0) -> tuple[list[str], int]:
    """The complete lines of ``log`` from byte ``start``, and the offset after them."""
    try:
        with open(log, "rb") as fh:
            fh.seek(start)
            data = fh.read()
    except OSError:
        return [], start
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), start + end


# bytes of a Unix socket's path (Linux's sun_path holds 108 with the terminating NUL)
_AF_UNIX_PATH_MAX = 107


def _multiprocessing_temp_dir() -> str:
    """multiprocessing's temporary folder (``pymp-*``, removed when this process exits), which
    holds the forkserver's socket: in ``$TMPDIR``, unless that would make the socket's path too
    long for AF_UNIX (a deep ``$TMPDIR``: ``OSError: AF_UNIX path too long`` at the launch), then
    in ``/tmp``."""
    socket_path = os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8, "listener-" + "x" * 8)
    if len(os.fsencode(socket_path)) < _AF_UNIX_PATH_MAX or not os.path.isdir("/tmp"):
        return mp.util.get_temp_dir()
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        return mp.util.get_temp_dir()  # made once per process, in /tmp
    finally:
        tempfile.tempdir = saved


def run_forked(module: str, argv: list[str], nproc: int, env: dict[str, str], *,
               master_addr: str = "127.0.0.1", timeout_s: float = 3600.0,
               on_line: Callable[[str], None] | None = None) -> tuple[int, list[str]]:
    """Run ``python -m module *argv`` as ``nproc`` ranks of one CPU node (``env``: each rank's
    environment on top of this process's); return the exit code (0, else the first failed
    rank's) and every rank's output lines (``[rankN]: ...``). ``on_line`` sees the ranks'
    lines as they come."""
    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # kept by a forkserver this process already started
    store = dist.TCPStore(master_addr, 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    rank_env = {**env, "MASTER_ADDR": master_addr, "MASTER_PORT": str(store.port),
                "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                # every rank joins the store above as a client, as torchrun's ranks join its
                # agent's store (torch.distributed.rendezvous reads this)
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with tempfile.TemporaryDirectory(prefix="megatron-hcp-ranks-") as tmp:
        logs = [str(Path(tmp) / f"rank{r}.log") for r in range(nproc)]
        own = str(Path(tmp) / "launcher.log")
        zygote = ctx.Process(target=_zygote, daemon=False, args=(
            module, argv, rank_env, logs, own, list(sys.path), timeout_s))
        # a forkserver started now keeps this environment (the ranks' own, GPUs hidden) and
        # puts torchinductor's cache (made when it imports megatron-core) in the folder that
        # multiprocessing removes when this process exits, not in $TMPDIR
        cache = str(Path(_multiprocessing_temp_dir()) / "torchinductor")
        with environment({"TORCHINDUCTOR_CACHE_DIR": cache,
                          **{k: v for k, v in env.items() if k in ("CUDA_VISIBLE_DEVICES",
                                                                   "OMP_NUM_THREADS")}}):
            zygote.start()
        shown, deadline = [0] * nproc, time.monotonic() + timeout_s + 60  # the zygote's first
        try:
            while zygote.exitcode is None and time.monotonic() < deadline:
                shown = _show(logs, shown, on_line)
                zygote.join(0.2)
        except BaseException as exc:  # Ctrl-C, SIGTERM, SIGHUP (.signals), a failing on_line:
            end_processes(zygote.pid, signal_of(exc))  # the signal to the ranks, then SIGKILL
            raise
        finally:  # the zygote hangs past the deadline: SIGKILL to it and every rank
            if zygote.exitcode is None:
                end_processes(zygote.pid, signal.SIGKILL)
                zygote.join()
        _show(logs, shown, on_line)
        code = zygote.exitcode
        lines = [f"[{name}]: {line}\n" for name, log in
                 [*((f"rank{r}", log) for r, log in enumerate(logs)), ("launcher", own)]
                 for line in _new_lines(Path(log))[0]]
    del store
    return (128 - code if code < 0 else code), lines


def _show(logs: list[str], shown: list[int], on_line: Callable[[str], None] | None
          ) -> list[int]:
    """Pass the new complete lines of every rank's log to ``on_line`` (as torchrun shows every
    rank's output); the new offsets."""
    if on_line is None:
        return shown
    out = []
    for log, start in zip(logs, shown):
        lines, end = _new_lines(Path(log), start)
        for line in lines:
            on_line(line)
        out.append(end)
    return out


def _zygote(module: str, argv: list[str], env: dict[str, str], logs: list[str], own: str,
            path: list[str], timeout_s: float) -> None:
    """Run the worker's ``prefork(argv)`` once, fork one rank per log, wait for them (see
    :func:`_wait`); exit with the run's code. Its process group holds the ranks."""
    os.setpgid(0, 0)
    _redirect(own)
    for entry in reversed(path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(env)
    worker = importlib.import_module(module)
    prefork = getattr(worker, "prefork", None)
    if prefork is not None:
        prefork(argv)
    gc.freeze()  # what every rank inherits lives as long as it: out of the collector's sight
    ctx = mp.get_context("fork")  # no thread runs here: a plain fork of this process
    procs = [ctx.Process(target=_rank_main, daemon=False, args=(
        worker, argv, {"RANK": str(r), "LOCAL_RANK": str(r)}, log))
        for r, log in enumerate(logs)]
    for proc in procs:
        proc.start()
    sys.exit(_wait(procs, timeout_s))


def _redirect(log: str) -> None:
    """This process's stdout and stderr to ``log`` (line-buffered)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115


def _rank_main(worker: Any, argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank: its output to ``log``, its rank variables, ``worker.main(argv)``."""
    _redirect(log)
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torch is imported
    sys.argv = [worker.__name__, *argv]
    code = worker.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def _wait(procs: list, timeout_s: float) -> int:
    """Wait for every rank; stop the rest ``_GRACE_S`` after the first failure, or all at the
    deadline. Returns the exit code (the first failure's; a signal N as 128 + N)."""
    deadline = time.monotonic() + timeout_s
    failed_at, code, stopped = None, 0, False
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at, code = time.monotonic(), bad[0]
        now = time.monotonic()
        if not stopped and ((failed_at is not None and now - failed_at > _GRACE_S)
                            or now > deadline):
            stopped, code = True, code or 124  # the deadline, as timeout(1) reports it
            for p in procs:
                if p.exitcode is None:
                    p.kill()
        time.sleep(0.2)
    for p in procs:
        p.join()
    code = code or next((c for c in codes if c), 0)
    return 128 - code if code < 0 else code
