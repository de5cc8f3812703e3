"""A reusable pool of local ranks joined in one torch.distributed world on 127.0.0.1: gloo (CPU
ranks, which see no GPU: ``CUDA_VISIBLE_DEVICES=""``), or NCCL with rank ``r`` on GPU ``r``
(started with ``spawn``: a forked process cannot initialize CUDA).

Starting a process and importing torch and megatron-core costs seconds per rank on a small
machine, so the ranks are started once (forked from a forkserver that has already imported the
heavy modules) and then run many functions: ``world.run(fn, *args)`` calls ``fn(*args)`` on every
rank and returns the per-rank results in rank order. ``fn`` must be a module-level function; it
reads its rank from ``torch.distributed.get_rank()``.

A rank that raises makes :meth:`LocalWorld.run` raise :class:`RankError` with that rank's
traceback. When some ranks did not answer (for example stuck in a collective that a failing
rank never joined) the world is torn down and restarted on the next call.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from ..group_release import release_destroyed_groups

__all__ = ["LocalWorld", "PRELOAD", "RankError", "environment"]

PRELOAD = ["torch", "torch.distributed", "numpy", "einops", "megatron.core"]


# kinds of rank errors that follow another rank's failure (waited, died, released by a world
# that stopped its collectives): the error message shows a real one first
_SECONDARY = ("Timeout", "ProcessDied", "ThreadDied", "Released")


class RankError(RuntimeError):
    """A function failed on one or more ranks; ``errors`` maps rank -> (type name, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str]]):
        self.errors = errors
        # a real traceback explains more than the time-outs of the ranks that waited for it
        real = [r for r, (kind, _) in errors.items() if kind not in _SECONDARY]
        first = min(real or errors)
        super().__init__(
            f"failed on rank(s) {sorted(errors)}; rank {first}:\n{errors[first][1]}"
        )


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    tasks: mp.Queue,
    results: mp.Queue,
    env: dict[str, str],
    backend: str,
    stack_path: str,
    share_device: bool,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    # what the forkserver preloaded (torch, megatron-core) lives as long as the process: out of
    # the collector's sight, every collection (automatic, or megatron's and Bridge's explicit
    # gc.collect() after each run) no longer walks those millions of objects
    gc.freeze()
    # a rank that does not answer in time writes every thread's stack (see LocalWorld.run)
    stack_file = open(stack_path, "w", encoding="utf-8")  # noqa: SIM115 - the process's life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank)
    elif share_device:  # one gloo loop thread per rank, not one per group
        from .gloo_device import share_gloo_device

        share_gloo_device(hostname="127.0.0.1")
    # The parent process owns the store server (bound to port 0, so no other process can take
    # the port between choosing and binding it); every rank joins as a client.
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        module, qualname, args, kwargs, path = task
        for entry in reversed(path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as exc:  # report everything, keep serving
            results.put((rank, False, (type(exc).__name__, traceback.format_exc())))
        # groups the task destroyed must not stay alive in megatron's caches until exit
        release_destroyed_groups(collect=False)
    dist.destroy_process_group()
    release_destroyed_groups()


_OPEN: weakref.WeakSet[LocalWorld] = weakref.WeakSet()  # worlds of non-daemonic ranks


@atexit.register
def _close_open_worlds() -> None:
    """Non-daemonic ranks are joined by multiprocessing at exit: stop them first."""
    for world in list(_OPEN):
        world.close()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set while processes start (restored after)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class LocalWorld:
    """``world_size`` local ranks in one world (``backend`` gloo or nccl); see the module
    docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        preload: list[str] | None = None,
        start_method: str | None = None,
        backend: str = "gloo",
        daemon: bool = True,
        grace_s: float = 30.0,
        share_gloo_device: bool = True,
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'gloo' or 'nccl'")
        # NCCL ranks initialize CUDA: they need a fresh interpreter (a process forked from one
        # that has asked CUDA anything - the forkserver imports torch and megatron - cannot
        # initialize it: "Cannot re-initialize CUDA in forked subprocess")
        start_method = start_method or ("spawn" if backend == "nccl" else "forkserver")
        if backend == "nccl" and start_method != "spawn":
            raise ValueError(f"backend='nccl' with start_method={start_method!r}: NCCL ranks "
                             "must start with 'spawn' (a forked process cannot initialize "
                             "CUDA); leave start_method unset")
        self.world_size = world_size
        self.backend = backend
        # daemon=False: ranks may start processes of their own (megatron's checkpoint writer
        # does); such a world is closed at exit if its owner did not close it
        self.daemon = daemon
        self.timeout_s = timeout_s
        # how much longer than a rank's own timeout run() waits before it calls the rank
        # silent (a rank's collective timeout, raised in the rank, is the better message)
        self.grace_s = grace_s
        # gloo ranks give all their groups one transport device (megatron_hcp.harness.gloo_device)
        self.share_gloo_device = share_gloo_device
        self.env = dict(env or {})
        self.preload = PRELOAD if preload is None else preload
        # "spawn" gives ranks a fresh interpreter: the forkserver is shared by every world of
        # a process and keeps the modules it preloaded first (and the environment it started
        # with: gloo worlds start it with the GPUs hidden)
        self.start_method = start_method
        self._procs: list[mp.Process] = []
        self._tasks: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._store: Any = None
        self._stacks: tempfile.TemporaryDirectory | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> LocalWorld:
        if self._procs:
            return self
        if self.backend == "nccl":
            import torch

            if torch.cuda.device_count() < self.world_size:
                raise ValueError(
                    f"backend='nccl' with world_size={self.world_size}: this machine has "
                    f"{torch.cuda.device_count()} CUDA GPU(s) and NCCL needs one per rank; use "
                    "fewer ranks or backend='gloo'")
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(self.preload)
        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
        )
        port = self._store.port
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        env = {"OMP_NUM_THREADS": "1", **self.env}
        if self.backend == "gloo":  # CPU ranks: no GPU to touch (torch itself probes CUDA
            env.setdefault("CUDA_VISIBLE_DEVICES", "")  # where it sees one, e.g. in optimizers)
        self._stacks = tempfile.TemporaryDirectory(prefix="megatron-hcp-stacks-")
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.timeout_s, self._tasks[r], self._results, env,
                      self.backend, os.path.join(self._stacks.name, f"rank{r}.txt"),
                      self.share_gloo_device),
                daemon=self.daemon,
            )
            for r in range(self.world_size)
        ]
        if not self.daemon:
            _OPEN.add(self)
        with environment(env if self.backend == "gloo" else {}):  # a forkserver started
            for proc in self._procs:  # now sees what the ranks see
                proc.start()
        return self

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._tasks, self._results = [], [], None
        self._store = None
        if self._stacks is not None:
            self._stacks.cleanup()
            self._stacks = None

    def __enter__(self) -> LocalWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each of ``ranks`` (where a hang is)."""
        assert self._stacks is not None
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2.0)
        stacks = {}
        for rank in ranks:
            path = os.path.join(self._stacks.name, f"rank{rank}.txt")
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    stacks[rank] = fh.read()[-20000:] or "(none written)"
            except OSError as exc:
                stacks[rank] = f"(none: {exc})"
        return stacks

    # -------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        self.start()
        assert self._results is not None
        module, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname:
            raise ValueError(f"{qualname} is not a module-level function")
        task = (module, qualname, args, kwargs, list(sys.path))
        for q in self._tasks:
            q.put(task)
        limit = (timeout_s or self.timeout_s) + self.grace_s
        deadline = time.monotonic() + limit
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        while len(results) + len(errors) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self.close()
                raise RankError({r: ("ProcessDied", f"rank {r} exited") for r in dead})
            try:
                rank, ok, value = self._results.get(timeout=min(1.0, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                    stacks = self._dump_stacks(missing)
                    for r in missing:  # stuck: no use waiting for them to take the stop
                        self._procs[r].kill()
                    self.close()
                    errors.update({r: ("Timeout", f"no answer in {limit:.0f}s; its stacks:\n"
                                          f"{stacks[r]}") for r in missing})
                    raise RankError(errors) from None
                continue
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]
