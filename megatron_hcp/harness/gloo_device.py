"""One gloo transport device per process, shared by every gloo process group it creates.

torch gives each gloo process group a transport device of its own (``ProcessGroupGloo(store,
rank, size, timeout)`` calls ``createDefaultDevice()``), and each device runs a loop thread
that wakes every 10 ms even when nothing is sent. megatron-core creates tens of groups per rank
(and dynamic CP more): eight ranks of one CPU job run hundreds of such threads, which on a
machine with fewer cores than ranks take CPU from the ranks and delay every collective.

:func:`share_gloo_device` makes the groups this process creates afterwards use one device
(gloo runs many contexts on one device, as on one network card). The groups, their algorithms,
ranks and results are unchanged; only the threads are fewer. It is used by the processes
megatron-hcp starts for CPU runs (:mod:`megatron_hcp.harness.local_world` ranks and the functional
recipes' workers) before their first group. ``GLOO_SOCKET_IFNAME`` is honoured as torch honours
it: one device per interface it lists.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed.distributed_c10d as c10d

__all__ = ["gloo_device_shared", "share_gloo_device"]

_SHARED: dict[str, Any] = {}  # this process's shared devices and the class they replaced


def _usable(hostname: str) -> bool:
    """Whether ``hostname`` resolves to an address this machine can bind (torch's test)."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def _devices(gloo: Any, hostname: str | None) -> list[Any]:
    """The devices torch would create for one group (``createDefaultDevice``: the interfaces
    of ``GLOO_SOCKET_IFNAME``, else this machine's hostname if it resolves to a local
    address, else the loopback address), or one device on ``hostname``."""
    if hostname is not None:
        return [gloo.create_device(hostname=hostname)]
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        return [gloo.create_device(interface=i) for i in interfaces]
    name = socket.gethostname()
    return [gloo.create_device(hostname=name if _usable(name) else "127.0.0.1")]


class _SharedDeviceGloo(type):
    """Metaclass of the stand-in for ``ProcessGroupGloo`` in ``distributed_c10d``: calls
    with (store, rank, size[, timeout]) build the real class on the shared devices; class
    attributes and ``isinstance`` checks are the real class's."""

    def __call__(cls, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> Any:
        gloo = _SHARED["class"]
        if args and isinstance(args[0], gloo._Options) or "options" in kwargs:
            return gloo(store, rank, size, *args, **kwargs)  # the caller chose its devices
        timeout = kwargs.pop("timeout", args[0] if args else datetime.timedelta(minutes=30))
        options = gloo._Options()
        options._devices = _SHARED["devices"]
        options._threads = 2 * len(_SHARED["devices"])  # torch's own count per group
        options._timeout = timeout
        return gloo(store, rank, size, options)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_SHARED["class"], name)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _SHARED["class"])

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _SHARED["class"])


class _ProcessGroupGloo(metaclass=_SharedDeviceGloo):
    """``ProcessGroupGloo`` whose groups share this process's gloo devices."""


def share_gloo_device(hostname: str | None = None) -> None:
    """From now on, every gloo group this process creates uses one shared device (see the
    module docstring), bound where torch would bind it, or to ``hostname`` (local ranks:
    ``"127.0.0.1"``). Call it before the first process group; calling it again does
    nothing."""
    if gloo_device_shared():
        return
    gloo = c10d.ProcessGroupGloo
    _SHARED.update({"class": gloo, "devices": _devices(gloo, hostname)})
    c10d.ProcessGroupGloo = _ProcessGroupGloo


def gloo_device_shared() -> bool:
    """Whether this process's gloo groups share one device."""
    return c10d.ProcessGroupGloo is _ProcessGroupGloo
