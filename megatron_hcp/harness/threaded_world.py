"""Ranks as threads of one process, joined in torch's threaded process group, on any device.

``ThreadedWorld(4, device="cuda")`` runs four ranks as threads that share one GPU (or the CPU):
``world.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the per-rank results in
rank order, like :class:`~megatron_hcp.harness.local_world.LocalWorld` (``fn`` reads its rank from
``torch.distributed.get_rank()``). Collectives are torch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``: all-to-all, all-gather,
reduce-scatter, all-reduce, broadcast ... as tensor copies between the ranks' own tensors, on
their device). That group has no point-to-point ops; the ring of CP attention needs
``isend``/``irecv`` (``batch_isend_irecv``), so this module's group adds them: a send posts a
copy of the tensor to a mailbox of the world, a receive waits for it and copies it into the
receive buffer. Every rank runs on the same device and, on CUDA, the same stream, so the copies
are ordered with the ranks' kernels.

This is how several CP ranks run the project's collectives on CUDA tensors with one GPU (NCCL
refuses two ranks on one device). It does not exercise NCCL: the NCCL path needs one GPU per
rank (``tests/gpu``). One threaded world per process at a time: torch's threaded group keeps
its collective state on the class.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..group_release import THREADED_BACKEND
from .local_world import RankError

__all__ = ["BACKEND", "ThreadedWorld", "ThreadedWorldError"]

BACKEND = THREADED_BACKEND  # the registered torch.distributed backend name of the rank threads
_POLL_S = 0.05


class ThreadedWorldError(RuntimeError):
    """A threaded world that cannot start here (device, nesting); says why and what to do."""


def _threaded_pg():
    """torch's threaded process group module (private to torch's tests; imported on use)."""
    from torch.testing._internal.distributed import multi_threaded_pg

    return multi_threaded_pg


class _Mailbox:
    """Point-to-point messages of one world, matched like a real backend matches them: per
    (group, source, destination, tag), the n-th receive *posted* gets the n-th message sent,
    whenever either is waited on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[tuple, dict[int, torch.Tensor]] = {}
        self._sent: dict[tuple, int] = {}
        self._posted: dict[tuple, int] = {}

    def send(self, key: tuple, tensor: torch.Tensor) -> None:
        with self._cond:
            seq = self._sent.get(key, 0)
            self._sent[key] = seq + 1
            self._messages.setdefault(key, {})[seq] = tensor
            self._cond.notify_all()

    def post_receive(self, key: tuple) -> int:
        """Reserve the next message of ``key``; returns its sequence number."""
        with self._cond:
            seq = self._posted.get(key, 0)
            self._posted[key] = seq + 1
            return seq

    def take(self, key: tuple, seq: int, timeout_s: float, aborted: Callable[[], bool]
             ) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while seq not in self._messages.get(key, {}):
                if aborted():
                    raise SystemExit("another rank failed")  # like torch's threaded group
                if time.monotonic() > deadline:
                    raise TimeoutError(f"irecv: no message within {timeout_s:.0f} s")
                self._cond.wait(_POLL_S)
            return self._messages[key].pop(seq)


def _make_group_class():
    mtpg = _threaded_pg()

    class _RecvWork(dist.Work):
        """Completes when its message (reserved when the receive was posted) arrived and was
        copied into ``tensor``."""

        def __init__(self, mailbox: _Mailbox, key: tuple, tensor: torch.Tensor,
                     timeout_s: float):
            super().__init__()
            self._mailbox, self._key, self._tensor = mailbox, key, tensor
            self._seq = mailbox.post_receive(key)
            self._timeout_s = timeout_s
            self._done = False

        def wait(self, timeout: timedelta | None = None) -> bool:
            if not self._done:
                payload = self._mailbox.take(self._key, self._seq, self._timeout_s,
                                             mtpg.ProcessLocalGroup._terminate.is_set)
                with torch.no_grad():
                    self._tensor.copy_(payload)
                self._done = True
            return True

        def is_completed(self) -> bool:
            return self._done

    class ThreadedP2PGroup(mtpg.ProcessLocalGroup):
        """torch's threaded process group plus ``send``/``recv`` through the world's mailbox."""

        def __init__(self, rank: int, world_size: int, mailbox: _Mailbox, timeout_s: float):
            super().__init__(rank, world_size)
            self._mailbox = mailbox
            self._timeout_s = timeout_s

        def send(self, tensors, dst: int, tag: int = 0):
            (tensor,) = tensors
            self._mailbox.send((self.pg_name, self._rank, dst, tag), tensor.detach().clone())
            return mtpg.ret_work(tensors)

        def recv(self, tensors, src: int, tag: int = 0):
            (tensor,) = tensors
            return _RecvWork(self._mailbox, (self.pg_name, src, self._rank, tag), tensor,
                             self._timeout_s)

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return BACKEND

    return ThreadedP2PGroup


@functools.cache
def _group_class():
    """The group class, built once per process on first use (it subclasses torch's)."""
    return _make_group_class()


def _create_group(prefix_store, rank: int, world_size: int, timeout: timedelta):
    """torch.distributed's backend constructor: only on the rank threads of a ThreadedWorld."""
    thread = threading.current_thread()
    if not isinstance(thread, _RankThread):
        raise ThreadedWorldError(
            f"backend {BACKEND!r} runs only on the rank threads of a ThreadedWorld "
            f"(called from thread {thread.name!r}); use ThreadedWorld(n).run(fn)")
    group = _group_class()(rank, world_size, thread.mailbox, thread.timeout_s)
    # every group of the world is created by all its ranks; wait until all did (as torch does)
    _threaded_pg()._store_based_barrier(rank, prefix_store, "", world_size, timeout)
    return group


def _register_backend() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu", "cuda"])


class _RankThread(threading.Thread):
    """One rank: joins the world, then runs the tasks it is given until told to stop."""

    def __init__(self, rank: int, world: ThreadedWorld, store: Any, results: queue.Queue):
        super().__init__(name=f"mhcp-rank-{rank}", daemon=True)
        self.rank = rank
        self.mailbox = world._mailbox
        self.timeout_s = world.timeout_s
        self._world_size = world.world_size
        self._device = world.device
        self._store = store
        self.tasks: queue.Queue = queue.Queue()
        self._results = results

    def run(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            dist.init_process_group(BACKEND, rank=self.rank, world_size=self._world_size,
                                    store=self._store,
                                    timeout=timedelta(seconds=self.timeout_s))
        except BaseException:  # report the start failure as the first task's result
            self._results.put((self.rank, False, ("StartFailed", traceback.format_exc())))
            return
        try:
            while (task := self.tasks.get()) is not None:
                fn, args, kwargs = task
                try:
                    self._results.put((self.rank, True, fn(*args, **kwargs)))
                except BaseException as exc:  # noqa: BLE001 - reported to the caller
                    mtpg = _threaded_pg()
                    # released from a collective because another rank failed: say so
                    kind = ("Released" if isinstance(exc, SystemExit)
                            and mtpg.ProcessLocalGroup._terminate.is_set()
                            else type(exc).__name__)
                    mtpg.ProcessLocalGroup.exception_handle(exc)  # free the others
                    self._results.put((self.rank, False, (kind, traceback.format_exc())))
        finally:
            dist.destroy_process_group()


class ThreadedWorld:
    """``world_size`` ranks as threads on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``)."""

    def __init__(self, world_size: int, *, device: str | torch.device = "cpu",
                 timeout_s: float = 120.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ThreadedWorldError(f"world_size={world_size!r}: must be an int >= 1")
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        if self.device.type not in ("cpu", "cuda"):
            raise ThreadedWorldError(f"device={device!r}: use 'cpu' or 'cuda[:index]'")
        self.timeout_s = timeout_s
        self._mailbox = _Mailbox()
        self._threads: list[_RankThread] = []
        self._results: queue.Queue | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> ThreadedWorld:
        if self._threads:
            return self
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ThreadedWorldError(
                f"device={self.device}: torch.cuda.is_available() is False here; use "
                "device='cpu'")
        if self.device.type == "cuda" and self.device.index >= torch.cuda.device_count():
            raise ThreadedWorldError(
                f"device={self.device}: this machine has {torch.cuda.device_count()} GPU(s)")
        mtpg = _threaded_pg()
        if isinstance(dist.distributed_c10d._world, mtpg.ThreadLocalWorld):
            raise ThreadedWorldError(
                "a threaded world is already running in this process; close it first")
        _register_backend()
        mtpg.ProcessLocalGroup.reset()
        # per-thread process-group registries (torch's thread isolation) and a per-thread
        # world; autograd runs each backward on its caller's thread (rank threads call backward
        # while others wait in collectives), as in torch's own threaded tests
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()
        self._mailbox = _Mailbox()
        self._results = queue.Queue()
        store = dist.HashStore()
        self._threads = [_RankThread(r, self, store, self._results)
                         for r in range(self.world_size)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        if not self._threads:
            return
        for thread in self._threads:
            thread.tasks.put(None)
        deadline = time.monotonic() + 10
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        self._threads, self._results = [], None
        mtpg = _threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)

    def __enter__(self) -> ThreadedWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        A rank that raises makes this raise
        :class:`~megatron_hcp.harness.local_world.RankError`; the world is then closed (the other
        ranks were released from their collectives) and restarts on the next call."""
        self.start()
        assert self._results is not None
        for thread in self._threads:
            thread.tasks.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s) + 30
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=_POLL_S * 10)
            except queue.Empty:
                dead = [t.rank for t in self._threads
                        if not t.is_alive() and t.rank not in results and t.rank not in errors]
                if dead or time.monotonic() > deadline:
                    kind = "ThreadDied" if dead else "Timeout"
                    for r in set(range(self.world_size)) - set(results) - set(errors):
                        errors[r] = (kind, f"rank {r}: {kind}")
                continue
            (results if ok else errors)[rank] = value
        if errors:  # release ranks still waiting in a collective, then start afresh next time
            _threaded_pg().ProcessLocalGroup.exception_handle(None)
            self.close()
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]
