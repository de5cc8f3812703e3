"""A CUDA device emulated on the CPU: find device mixes of a GPU run on a machine without one.

``with virtual_cuda(index) as audit:`` makes this process look like a rank of an NCCL job on
GPU ``index`` while every tensor keeps its data on the CPU:

* ``torch.cuda`` (and ``torch.accelerator``) answer as on a machine with CUDA - available,
  current device, streams, events, RNG states, memory figures - without touching a driver;
* a tensor created on, or moved to, ``cuda`` holds its data on the CPU and reports the device
  it would be on (``.device``, ``.is_cuda``, ``.get_device()``); the device is a mark on its
  storage, so views, ``.data`` and megatron's ``param.data = buffer[...]`` keep it;
* every aten op, forward and backward, checks its tensors as CUDA kernels do: one device, CPU
  scalars (0-dim) allowed, CPU indices for a CUDA tensor allowed, copies across devices
  allowed; process groups report the backend they would have (``nccl``, unless created for
  gloo) and a collective over an NCCL group on a CPU tensor is a mix too.

A mix is recorded (:class:`DeviceMix`: the op, the two devices, the innermost file:line outside
torch - for a backward op, its forward op's) and the op still runs, on the CPU data: the step
goes on, every rank finishes its collectives, and ``audit.mixes`` lists each place once, in
order. Values are real, so a whole training step runs (``.item()``, data-dependent shapes,
real collectives between rank processes over gloo, which carries the CPU data).

Why not ``torch._subclasses.FakeTensorMode``: its CUDA tensors reach the autograd engine as CUDA
tensors, and without a CUDA driver the engine cannot run their backward (CPU wheel: the process
aborts, "PyTorch is not linked with support for cuda devices"; CUDA build without a driver:
"hasPrimaryContext expects a valid device index"); its tensors hold no values, and a training
step reads values (gradient norms, packed lengths, the loss). The mix rule here is the one
FakeTensorMode applies (``_find_common_device``), written for tensors that hold data.

``torch.compile``'d functions run eagerly under the emulation (dynamo is disabled): their Python
is audited, not the kernels a GPU would compile.

The emulation is process-wide while it is active (``torch.cuda``, ``torch.Tensor``'s device
properties, ``torch.distributed``'s group creation); run it in processes of its own. Once used,
torch in that process believes CUDA was initialized: do not use a real GPU in it afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DeviceMix", "VirtualCuda", "virtual_cuda", "virtual_device"]

_TAG = "_megatron_hcp_virtual_device"
_CPU = torch.device("cpu")
_REAL_DEVICE = torch._C.TensorBase.device.__get__
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_aten = torch.ops.aten
_GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMix:
    """One op that would have mixed devices on the GPU (``kind="mix"``), or one use of CUDA by a
    run that must stay on the CPU (``kind="cuda-in-cpu-run"``)."""

    op: str
    devices: tuple[str, str]
    location: str  # innermost file:line outside torch (backward: the forward op's)
    phase: str = "forward"  # "forward" or "backward"
    kind: str = "mix"

    def line(self) -> str:
        where = " (backward)" if self.phase == "backward" else ""
        if self.kind == "cuda-in-cpu-run":
            return f"CUDA used by a CPU run: {self.op}{where} at {self.location}"
        return (f"device mix: {self.op} on {self.devices[0]} and {self.devices[1]}{where} at "
                f"{self.location}")

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "devices": list(self.devices), "location": self.location,
                "phase": self.phase, "kind": self.kind}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceMix:
        return cls(data["op"], tuple(data["devices"]), data["location"], data["phase"],
                   data.get("kind", "mix"))


# ------------------------------------------------------------------------ device marks
# A tensor torch's own C++ code created from a real tensor's options (``at::zeros(sizes,
# grad.options())`` in a backward formula, ``self.options()`` in a composite kernel): on the GPU
# it is on that tensor's device, which here reads "cpu". It takes the device of the first
# tensors it meets in an op.
_ANY = "any device"
_INTENT = threading.local()  # devices Python code asked for, innermost last


def _real_device(t: torch.Tensor) -> torch.device:
    """Where ``t``'s data is (the C getter, with no torch-function mode or subclass asked)."""
    with torch._C.DisableTorchFunction():
        return _REAL_DEVICE(t)


def _tag(t: torch.Tensor) -> Any:
    with torch._C.DisableTorchFunction():
        if _REAL_DEVICE(t).type != "cpu":
            return None
        try:
            return getattr(t.untyped_storage(), _TAG, None)
        except (RuntimeError, NotImplementedError, TypeError):
            return None


def virtual_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` would be on: its storage's mark, else where its data is."""
    tag = _tag(t)
    return tag if isinstance(tag, torch.device) else _real_device(t)


def _mark(t: torch.Tensor, device: Any) -> None:
    """Put ``t``'s storage on ``device`` (a torch.device, or :data:`_ANY`)."""
    if _real_device(t).type != "cpu":
        return
    with torch._C.DisableTorchFunction():
        storage = t.untyped_storage()
    if isinstance(device, torch.device) and device.type == "cpu":
        if hasattr(storage, _TAG):
            delattr(storage, _TAG)
    else:
        setattr(storage, _TAG, device)


def _python_asked_cpu() -> bool:
    """Python code (not torch's C++) asked for the CPU in the call being dispatched."""
    stack = getattr(_INTENT, "stack", None)
    return bool(stack) and stack[-1].type == "cpu"


# ------------------------------------------------------------------------ locations
def _short(path: str) -> str:
    """A path as a reader finds it: from the package root (site-packages or the checkout)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    for top in ("megatron_hcp", "megatron", "tests"):
        cut = os.sep + top + os.sep
        if cut in path:
            return top + os.sep + path.rsplit(cut, 1)[1]
    return path


@functools.lru_cache(maxsize=4096)
def _internal(path: str) -> bool:
    return path.startswith(_TORCH_DIR) or os.path.abspath(path) == _THIS_FILE


def _innermost(frames: list[tuple[str, int, str]]) -> str:
    for filename, lineno, name in reversed(frames):
        if not _internal(filename):
            return f"{_short(filename)}:{lineno} in {name}"
    return "(inside torch)"


def _forward_location(node: Any) -> str:
    """The forward op of an autograd node, from anomaly mode's record of its stack."""
    stack = getattr(node, "metadata", {}).get("traceback_")
    if not stack:
        return "(forward op not recorded)"
    frames = []
    for text in stack:  # traceback.format_stack() lines: '  File "x.py", line 3, in f\n ...'
        head = text.strip().splitlines()[0]
        if head.startswith('File "'):
            filename, rest = head[6:].split('", line ', 1)
            lineno, _, name = rest.partition(", in ")
            frames.append((filename, int(lineno), name))
    return _innermost(frames)


def _here() -> tuple[str, str]:
    """(location, phase) of the op being dispatched now."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"{_forward_location(node)} ({node.name()})", "backward"
    frame, frames = sys._getframe(1), []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name))
        frame = frame.f_back
    return _innermost(frames[::-1]), "forward"


# ------------------------------------------------------------------------ the mix rule
_COPIES = {_aten.copy_.default, _aten.copy.default, _aten._copy_from.default,
           _aten._copy_from_and_resize.default}
_INDEXED = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
            _aten._index_put_impl_.default, _aten._unsafe_index.Tensor,
            _aten._unsafe_index_put.default}
_NOT_CHECKED_C10D = {"barrier", "monitored_barrier_"}


def _tensors(*trees: Any) -> list[torch.Tensor]:
    """The tensors of aten arguments or results: tensors, or sequences / dicts of them."""
    out: list[torch.Tensor] = []
    for item in trees:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out += _tensors(*item)
        elif isinstance(item, dict):
            out += _tensors(*item.values())
    return out


def _normalize(device: Any, current: int) -> torch.device:
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current)
    return device


class _Merge:
    """FakeTensorMode's common-device rule: one device, CPU scalars defer to the other."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.scalar = False
        self.clash: tuple[torch.device, torch.device] | None = None

    def add(self, device: Any, dim: int) -> None:
        if device is _ANY:
            return
        scalar = device.type == "cpu" and dim == 0
        if self.device is None:
            self.device, self.scalar = device, scalar
        elif device == self.device:
            self.scalar = self.scalar and scalar
        elif scalar:
            return
        elif self.scalar:
            self.device, self.scalar = device, scalar
        elif self.clash is None:
            self.clash = (self.device, device)
            if device.type != "cpu":  # go on as the GPU side would
                self.device = device


def _where(t: torch.Tensor) -> tuple[Any, int | None]:
    """(device, or _ANY; id of the storage) of ``t``; torch functions must be disabled."""
    real = _REAL_DEVICE(t)
    if real.type != "cpu":
        return real, None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return real, None
    return getattr(storage, _TAG, real), id(storage)


# ------------------------------------------------------------------------ torch.cuda
class _Stream:
    """A CUDA stream or event of the emulated device: work is already in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_stream = 0
        self.cuda_event = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    __hash__ = object.__hash__

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Stream:
        return event if event is not None else _Stream()

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -1)

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _CudaRuntime:
    """What ``torch.cuda`` answers under the emulation (one rank's view of its node)."""

    def __init__(self, index: int, count: int):
        self.index, self.count = index, count
        self.generators = tuple(torch.Generator().manual_seed(67280421310721 + i)
                                for i in range(count))

    def _generator(self, device: Any = "cuda") -> torch.Generator:
        return self.generators[_normalize(device, self.index).index]

    def table(self) -> dict[str, Any]:
        this = self

        class device:  # noqa: N801 - torch.cuda.device
            def __init__(self, dev: Any) -> None:
                self.dev = -1 if dev is None or dev == -1 else _normalize(dev, this.index).index
                self.prev = this.index

            def __enter__(self) -> None:
                self.prev = this.index
                if self.dev >= 0:
                    this.index = self.dev

            def __exit__(self, *exc: object) -> None:
                this.index = self.prev

        def set_device(dev: Any) -> None:
            this.index = _normalize(dev, this.index).index

        def properties(dev: Any = None) -> SimpleNamespace:
            return SimpleNamespace(name="virtual CUDA device (megatron-hcp device audit)",
                                   major=9, minor=0, total_memory=80 * _GiB,
                                   multi_processor_count=132, L2_cache_size=50 << 20,
                                   is_integrated=False, uuid="virtual")

        def get_rng_state(device: Any = "cuda") -> torch.Tensor:
            return this._generator(device).get_state()

        def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
            this._generator(device).set_state(state)

        def manual_seed(seed: int) -> None:
            this._generator().manual_seed(int(seed))

        def manual_seed_all(seed: int) -> None:
            for g in this.generators:
                g.manual_seed(int(seed))

        def zero(*args: Any, **kwargs: Any) -> int:
            return 0

        def nothing(*args: Any, **kwargs: Any) -> None:
            return None

        def stream(s: Any = None) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext(s)

        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True, "_lazy_init": nothing, "init": nothing,
            "device_count": lambda: this.count, "current_device": lambda: this.index,
            "set_device": set_device, "device": device, "device_of": lambda t: device(
                t.get_device()),
            "synchronize": nothing, "empty_cache": nothing, "ipc_collect": nothing,
            "Stream": _Stream, "Event": _Stream, "ExternalStream": _Stream,
            "current_stream": lambda device=None: _Stream(),
            "default_stream": lambda device=None: _Stream(), "stream": stream,
            "set_stream": nothing, "is_current_stream_capturing": lambda: False,
            "get_rng_state": get_rng_state, "set_rng_state": set_rng_state,
            "get_rng_state_all": lambda: [g.get_state() for g in this.generators],
            "set_rng_state_all": lambda states: [g.set_state(s)
                                                 for g, s in zip(this.generators, states)],
            "manual_seed": manual_seed, "manual_seed_all": manual_seed_all,
            "seed": nothing, "seed_all": nothing,
            "initial_seed": lambda: this._generator().initial_seed(),
            "default_generators": this.generators,
            "get_device_properties": properties,
            "get_device_name": lambda device=None: properties().name,
            "get_device_capability": lambda device=None: (9, 0),
            "is_bf16_supported": lambda *a, **k: True,
            "memory_allocated": zero, "max_memory_allocated": zero, "memory_reserved": zero,
            "max_memory_reserved": zero, "reset_peak_memory_stats": nothing,
            "reset_max_memory_allocated": nothing, "memory_stats": lambda device=None:
            collections.defaultdict(int),
            "mem_get_info": lambda device=None: (80 * _GiB, 80 * _GiB),
            "utilization": zero, "temperature": zero, "power_draw": zero, "clock_rate": zero,
            "check_error": nothing,
            "cudart": lambda: SimpleNamespace(cudaProfilerStart=nothing,
                                              cudaProfilerStop=nothing),
        }


# ------------------------------------------------------------------------ the modes
# torch's factories that take no tensor: called from Python without ``device`` they make CPU
# tensors (torch's C++ code passes a device explicitly; see _ANY)
_FACTORIES = frozenset(getattr(torch, name) for name in (
    "empty", "empty_strided", "zeros", "ones", "full", "rand", "randn", "randint", "randperm",
    "arange", "range", "linspace", "logspace", "eye", "scalar_tensor", "tril_indices",
    "triu_indices", "normal") if hasattr(torch, name))


class _Move(torch.autograd.Function):
    """A copy to another device; its gradient goes back to the source device (as
    ``_to_copy``'s does on the GPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.device, audit: VirtualCuda
                ) -> torch.Tensor:
        ctx.source, ctx.audit = virtual_device(x), audit
        out = x.clone()
        audit.place(out, target)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.clone()
        ctx.audit.place(out, ctx.source)
        return out, None, None


class _TensorAPI(TorchFunctionMode):
    """Python-level tensor calls whose device the dispatcher never sees as such."""

    def __init__(self, audit: VirtualCuda):
        super().__init__()
        self.audit = audit
        self.handlers = {
            torch.Tensor.to: self._to, torch.Tensor.cuda: self._cuda,
            torch.Tensor.cpu: self._cpu, torch.tensor: self._create,
            torch.as_tensor: self._as_tensor, torch.asarray: self._as_tensor,
            torch.Tensor.new_tensor: self._new_tensor,
            torch.Tensor.__deepcopy__: self._deepcopy, torch.Tensor.numpy: self._numpy,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(func, args, dict(kwargs))
        if kwargs.get("device") is not None:  # Python code asks for a device
            asked = self._device(kwargs["device"])
            kwargs = {**kwargs, "device": asked}  # an index means a CUDA device here
        elif func in _FACTORIES:  # ... or for the default one
            asked = _CPU
        else:
            return func(*args, **kwargs)
        stack = _INTENT.__dict__.setdefault("stack", [])
        stack.append(asked)
        try:
            return func(*args, **kwargs)
        finally:
            stack.pop()

    def _device(self, device: Any) -> torch.device:
        return _normalize(device, self.audit.runtime.index)

    def _move(self, t: torch.Tensor, target: torch.device | None, rest: Any) -> torch.Tensor:
        """``t`` converted by ``rest()`` (dtype, format) and moved to ``target``."""
        out = rest()
        if target is None or target == virtual_device(t):
            return out
        return _Move.apply(out, target, self.audit)

    def _to(self, func, args, kwargs):
        """``Tensor.to`` in its three forms: (device, dtype, non_blocking, copy), (dtype,
        non_blocking, copy) and (tensor, non_blocking, copy)."""
        t, rest = args[0], list(args[1:])
        target: Any = None
        dtype = None
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest.pop(0)
            target, dtype, names = virtual_device(other), other.dtype, ("non_blocking", "copy")
        elif rest and (rest[0] is None or isinstance(rest[0], (str, torch.device, int))):
            target, names = rest.pop(0), ("dtype", "non_blocking", "copy")
        else:
            names = ("dtype", "non_blocking", "copy")
        named = dict(zip(names, rest))
        named.update(kwargs)
        target = named.pop("device", target)
        dtype = named.pop("dtype", None) or dtype
        target = None if target is None else self._device(target)
        return self._move(t, target, lambda: func(t, dtype=dtype, **named))

    def _cuda(self, func, args, kwargs):
        t = args[0]
        device = args[1] if len(args) > 1 else kwargs.get("device")
        target = self._device("cuda" if device is None else device)
        fmt = kwargs.get("memory_format", torch.preserve_format)
        return self._move(t, target, lambda: torch.Tensor.to(t, memory_format=fmt))

    def _cpu(self, func, args, kwargs):
        t = args[0]
        fmt = kwargs.get("memory_format", torch.preserve_format)
        return self._move(t, _CPU, lambda: torch.Tensor.to(t, memory_format=fmt))

    def _create(self, func, args, kwargs):
        device = kwargs.pop("device", None)
        kwargs.pop("pin_memory", None)
        out = func(*args, **kwargs)
        target = self._device(device) if device is not None else (
            virtual_device(args[0]) if args and isinstance(args[0], torch.Tensor) else _CPU)
        self.audit.place(out, target)
        return out

    def _as_tensor(self, func, args, kwargs):
        data = args[0] if args else kwargs.get("obj", kwargs.get("data"))
        if isinstance(data, torch.Tensor) and kwargs.get("copy") is not True:
            device = kwargs.pop("device", None)
            target = self._device(device) if device is not None else None
            return self._move(data, target, lambda: func(*args, **kwargs))
        return self._create(func, args, kwargs)

    def _new_tensor(self, func, args, kwargs):
        device = kwargs.pop("device", None)
        target = self._device(device) if device is not None else virtual_device(args[0])
        out = func(*args, **kwargs)
        self.audit.place(out, target)
        return out

    def _numpy(self, func, args, kwargs):
        device = virtual_device(args[0])
        if device.type != "cpu":
            location, phase = _here()
            self.audit.record(DeviceMix("Tensor.numpy() (needs a CPU tensor)",
                                        (str(device), "numpy"), location, phase))
        return func(*args, **kwargs)

    def _deepcopy(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.audit.place(out, virtual_device(args[0]))
        return out


class _Kernels(TorchDispatchMode):
    """Every aten op (forward and backward) and every collective, checked as on the GPU."""

    def __init__(self, audit: VirtualCuda):
        super().__init__()
        self.audit = audit

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """torch wraps a mode's handler in a dynamo-disable frame (~100 us per op, 10x the
        rest of the audit); dynamo is off while the emulation is on, so it opts out."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _aten.record_stream.default:
            return None
        if func is _aten.is_pinned.default:
            return False
        if func is _aten._pin_memory.default:
            return args[0].clone()
        if func.namespace == "c10d":
            self._collective(func, args)
            return func(*args, **kwargs)
        target: Any = None
        if kwargs.get("device") is not None:
            asked = _normalize(kwargs["device"], self.audit.runtime.index)
            if asked.type == "cuda":
                target = asked
                kwargs["device"] = _CPU
            elif asked.type == "cpu" and func is not _aten._to_copy.default:
                # Python asked for the CPU, or torch's C++ code passed a tensor's options
                target = asked if _python_asked_cpu() else _ANY
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        inputs = _tensors(args, kwargs)
        with torch._C.DisableTorchFunction():
            where = {id(t): _where(t) for t in inputs}
        if target is _ANY and inputs:  # options of a tensor given to the op: its device
            target = None
        if func in _COPIES:
            self._copy(args, where)
            return func(*args, **kwargs)
        result = target if target is not None else self._check(func, args, inputs, where)
        if (isinstance(result, torch.device) and result.type == "cuda"
                and torch.Tag.nondeterministic_seeded in func.tags):
            out = self._seeded(func, args, kwargs, result)
        else:
            out = func(*args, **kwargs)
        if result is None and inputs and all(d is _ANY for d, _ in where.values()):
            result = _ANY  # made from tensors of any device only
        if result is None or (result is not _ANY and result.type == "cpu" and not any(
                d is _ANY for d, _ in where.values())):
            return out
        seen = {sid for _, sid in where.values()}
        if result is not _ANY:  # tensors of any device take the op's device
            for t in inputs:
                if where[id(t)][0] is _ANY:
                    _mark(t, result)
        for t in _tensors(out):
            with torch._C.DisableTorchFunction():
                _, sid = _where(t)
            if sid is not None and sid not in seen:
                if result is _ANY:
                    _mark(t, _ANY)
                elif result.type != "cpu":
                    self.audit.place(t, result)
        return out

    def _copy(self, args, where) -> None:
        """A copy between devices is allowed; a destination of any device takes the source's."""
        dst, src = args[0], args[1] if len(args) > 1 else None
        if isinstance(src, torch.Tensor) and where[id(dst)][0] is _ANY \
                and where[id(src)][0] is not _ANY:
            _mark(dst, where[id(src)][0])

    def _seeded(self, func, args, kwargs, device: torch.device) -> Any:
        """A random op of a CUDA device draws from that device's generator, as on the GPU
        (megatron's RNG tracker checks that its CUDA forks leave the CPU generator alone)."""
        generator = self.audit.runtime.generators[device.index]
        cpu = torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu)

    def _check(self, func, args, inputs, where) -> Any:
        """The device of the op's result (None: no tensor of a known device); records a mix."""
        if func is _aten._to_copy.default:  # a cast: the device stays (moves are _Move)
            device = where[id(args[0])][0]
            return None if device is _ANY else device
        name = func.name()
        if name.startswith("aten::_foreach_") or name.startswith("aten::_fused_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a
                     and isinstance(a[0], torch.Tensor)]
            device = None
            for row in zip(*lists):
                merge = _Merge()
                for t in row:
                    merge.add(where[id(t)][0], t.dim())
                self._clash(func, merge)
                device = device or merge.device
            return device
        merge = _Merge()
        if func in _INDEXED:
            indices = args[1] if len(args) > 1 else []
            index_ids = {id(i) for i in indices if isinstance(i, torch.Tensor)}
            for t in inputs:
                if id(t) not in index_ids:
                    merge.add(where[id(t)][0], t.dim())
            for index in indices:  # CPU indices of a CUDA tensor are moved by the kernel
                if isinstance(index, torch.Tensor):
                    at = where[id(index)][0]
                    if at is not _ANY and at.type != "cpu" and merge.device is not None \
                            and at != merge.device and merge.clash is None:
                        merge.clash = (merge.device, at)
        else:
            for t in inputs:
                merge.add(where[id(t)][0], t.dim())
        self._clash(func, merge)
        return merge.device

    def _clash(self, func, merge: _Merge) -> None:
        if merge.clash is not None:
            location, phase = _here()
            self.audit.record(DeviceMix(str(func), (str(merge.clash[0]), str(merge.clash[1])),
                                        location, phase))

    def _collective(self, func, args) -> None:
        if self.audit.cpu_run or func._schema.name.split("::")[-1] in _NOT_CHECKED_C10D:
            return
        groups = []
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    groups.append(dist.ProcessGroup.unbox(a))
                except RuntimeError:
                    continue
        if not any(self.audit.backend_of(g) == "nccl" for g in groups):
            return
        for t in _tensors(args):
            device = virtual_device(t)
            if device.type != "cuda":
                location, phase = _here()
                self.audit.record(DeviceMix(f"{func} over an NCCL group",
                                            (str(device), "NCCL (CUDA tensors only)"),
                                            location, phase))
                return


# ------------------------------------------------------------------------ the audit
@dataclass
class VirtualCuda:
    """The state of one emulation (see :func:`virtual_cuda`)."""

    runtime: _CudaRuntime
    cpu_run: bool = False  # the run must stay on the CPU: every use of CUDA is a finding
    mixes: list[DeviceMix] = field(default_factory=list)
    backends: dict[str, str] = field(default_factory=dict)  # group name -> emulated backend
    _seen: set[tuple[str, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, mix: DeviceMix) -> None:
        with self._lock:
            key = (mix.op, mix.location)
            if key not in self._seen:
                self._seen.add(key)
                self.mixes.append(mix)

    def place(self, t: torch.Tensor, device: torch.device) -> None:
        """Put ``t`` on ``device`` (its storage's mark); in a CPU run, CUDA is a finding."""
        if self.cpu_run and device.type == "cuda":
            self.touched(f"a tensor placed on {device}")
        _mark(t, device)

    def touched(self, what: str) -> None:
        """A CPU run used CUDA (``what``): record where."""
        location, phase = _here()
        self.record(DeviceMix(what, ("cpu", "cuda"), location, phase, kind="cuda-in-cpu-run"))

    def backend_of(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return self.backends.get("__world__", "nccl")
        name = getattr(group, "group_name", None)
        return self.backends.get(name, "nccl")


def _emulated_backend(requested: Any) -> str:
    text = str(requested or "").lower()
    if not text or "nccl" in text or text in ("undefined", "cuda"):
        return "nccl"
    return "gloo" if "gloo" in text or text == "cpu" else text


@contextlib.contextmanager
def _replaced(table: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type)
              else getattr(obj, name, _MISSING)) for obj, name, _ in table]
    try:
        for obj, name, value in table:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, value)


_MISSING = object()


def _distributed(audit: VirtualCuda) -> list[tuple[Any, str, Any]]:
    """``torch.distributed`` as an NCCL job sees it; groups are created on the real backend."""
    c10d = dist.distributed_c10d
    new_group_with_tag = c10d._new_group_with_tag
    object_device = getattr(c10d, "_get_object_coll_device", None)
    get_backend = dist.get_backend

    def _group_on_the_real_backend(*args: Any, **kwargs: Any) -> Any:
        names = ("ranks", "timeout", "backend", "backend_options")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        requested = bound.pop("backend", None)
        bound.pop("backend_options", None)
        group = new_group_with_tag(**bound)
        if group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            audit.backends[group.group_name] = _emulated_backend(requested)
        return group

    def _get_backend(group: Any = None) -> str:
        get_backend(group)  # its own errors (a group this rank is not in)
        return audit.backend_of(group)

    def _object_device(group: Any = None) -> torch.device:
        if audit.backend_of(group) == "nccl":
            return torch.device("cuda", audit.runtime.index)
        return object_device(group)

    table = [(c10d, "_new_group_with_tag", _group_on_the_real_backend),
             (dist, "get_backend", _get_backend),
             (c10d, "get_backend", _get_backend), (dist, "is_nccl_available", lambda: True),
             (c10d, "is_nccl_available", lambda: True)]
    if object_device is not None:
        table.append((c10d, "_get_object_coll_device", _object_device))
    return table


_PLAIN_TORCH_FUNCTION = {torch.Tensor.__torch_function__.__func__,
                         torch._C._disabled_torch_function_impl}
_ORIGINAL_GETTERS = {name: getattr(torch.Tensor, name).__get__
                     for name in ("device", "is_cuda", "is_cpu")}


def _own_torch_function(t: torch.Tensor) -> bool:
    """A tensor subclass with a ``__torch_function__`` of its own (e.g. a ShardedTensor):
    its device is its own business, asked the way torch asks it."""
    impl = type(t).__torch_function__
    return getattr(impl, "__func__", impl) not in _PLAIN_TORCH_FUNCTION


def _device_property(name: str, of_device: Any) -> property:
    getter = _ORIGINAL_GETTERS[name]

    def get(self: torch.Tensor) -> Any:
        if _own_torch_function(self):
            return type(self).__torch_function__(getter, (type(self),), (self,), {})
        return of_device(virtual_device(self))

    return property(get)


def _tensor_properties() -> list[tuple[Any, str, Any]]:
    def get_device(self: torch.Tensor) -> int:
        device = virtual_device(self)
        return device.index if device.type == "cuda" else -1

    return [(torch.Tensor, "device", _device_property("device", lambda d: d)),
            (torch.Tensor, "is_cuda", _device_property("is_cuda", lambda d: d.type == "cuda")),
            (torch.Tensor, "is_cpu", _device_property("is_cpu", lambda d: d.type == "cpu")),
            (torch.Tensor, "get_device", get_device)]


# what a process may ask torch.cuda without initializing CUDA (torch/cuda/__init__.py, memory.py,
# random.py: counts, memory figures and the cache release look at is_initialized() first; seeds
# and RNG states set before initialization are queued with _lazy_call)
_WITHOUT_INIT = frozenset({
    "is_available", "device_count", "is_initialized", "empty_cache", "memory_stats",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all",
    "utilization", "temperature", "power_draw", "clock_rate"})


def _touching(audit: VirtualCuda, name: str, value: Any) -> Any:
    """``torch.cuda.<name>`` that records its use by the run's code (megatron, the project,
    Bridge) as a finding of a CPU run. torch's own probes are not findings (e.g. its optimizers
    ask whether the current CUDA stream is capturing a graph): the launchers hide the GPUs from
    CPU runs (``CUDA_VISIBLE_DEVICES=""``), so torch sees none there."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _internal(sys._getframe(1).f_code.co_filename):
            audit.touched(f"torch.cuda.{name}()")
        return value(*args, **kwargs)

    return call


def _cuda_modules(runtime: _CudaRuntime, audit: VirtualCuda) -> list[tuple[Any, str, Any]]:
    table = runtime.table()
    if audit.cpu_run:  # a machine with CUDA; the run must not initialize it
        table = {name: value if name in _WITHOUT_INIT or not callable(value)
                 else _touching(audit, name, value) for name, value in table.items()}
        table["is_initialized"] = lambda: False
    out: list[tuple[Any, str, Any]] = [(torch.cuda, name, value) for name, value in table.items()]
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                 "get_rng_state_all", "set_rng_state_all", "seed", "seed_all", "initial_seed"):
        out.append((torch.cuda.random, name, table[name]))
    for name in ("range_push", "range_pop", "mark"):
        out.append((torch.cuda.nvtx, name, lambda *a, **k: 0))
    out.append((torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext()))
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:  # torch's device-generic API (optimizers ask it)
        same = {"is_available": "is_available", "device_count": "device_count",
                "current_device_index": "current_device", "current_device_idx": "current_device",
                "set_device_index": "set_device", "set_device_idx": "set_device",
                "synchronize": "synchronize", "current_stream": "current_stream",
                "set_stream": "set_stream", "empty_cache": "empty_cache",
                "memory_allocated": "memory_allocated",
                "max_memory_allocated": "max_memory_allocated",
                "memory_reserved": "memory_reserved", "max_memory_reserved": "max_memory_reserved",
                "memory_stats": "memory_stats", "reset_peak_memory_stats":
                "reset_peak_memory_stats", "get_device_capability": "get_device_capability",
                "get_memory_info": "mem_get_info", "device_index": "device"}
        out += [(accelerator, name, table[cuda]) for name, cuda in same.items()
                if hasattr(accelerator, name)]
        out.append((accelerator, "current_accelerator",
                    lambda *a, **k: torch.device("cuda", runtime.index)))
    return out


@contextlib.contextmanager
def virtual_cuda(index: int = 0, *, device_count: int = 8, cpu_run: bool = False,
                 forward_stacks: bool = True) -> Iterator[VirtualCuda]:
    """Emulate GPU ``index`` of a node with ``device_count`` GPUs in this process (module
    docstring); yields the :class:`VirtualCuda` whose ``mixes`` the run records.

    ``cpu_run``: the process runs on the CPU of a machine that has these GPUs (gloo, the CPU
    runtime): the run must never use CUDA, so every CUDA call that would initialize it and
    every tensor placed on a GPU is recorded (``kind="cuda-in-cpu-run"``), besides mixes;
    process groups keep their real backend.

    ``forward_stacks``: a mix in a backward op is located at its forward op (autograd's anomaly
    mode records every forward op's stack: about 3x the cost of an op); without, at the
    backward node's name only."""
    if not 0 <= index < device_count:
        raise ValueError(f"virtual_cuda: index={index} must be in 0..{device_count - 1}; "
                         "pass this rank's local rank")
    import torch._dynamo  # noqa: F401  (imported lazily by torch, it must see the real torch.cuda)

    runtime = _CudaRuntime(index, device_count)
    audit = VirtualCuda(runtime, cpu_run=cpu_run)
    api = _TensorAPI(audit)
    table = _cuda_modules(runtime, audit) + _tensor_properties() + [_custom_backwards(api)]
    if not cpu_run:
        table += _distributed(audit)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(table))
        # torch.compile'd functions (megatron's and Bridge's fusions) run eagerly: kernels
        # compiled for a GPU cannot run on the CPU data, and their Python is what is audited
        stack.enter_context(torch._dynamo.config.patch(disable=True))
        if forward_stacks:
            stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        stack.enter_context(api)
        stack.enter_context(_Kernels(audit))
        yield audit


def _custom_backwards(api: _TensorAPI) -> tuple[Any, str, Any]:
    """Python ``backward`` of custom autograd functions (megatron's, the reference attention's)
    under the tensor-API mode too: the autograd engine carries dispatch modes into backward,
    not torch-function modes."""
    cls = torch.autograd.function.BackwardCFunction
    original = cls.apply
    active = torch.overrides._get_current_function_mode_stack

    def apply(self: Any, *args: Any) -> Any:
        if any(mode is api for mode in active()):
            return original(self, *args)
        with api:
            return original(self, *args)

    return (cls, "apply", apply)
