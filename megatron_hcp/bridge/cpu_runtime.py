"""CPU/gloo runtime for Megatron-Bridge's own training loop (``pretrain`` / ``finetune``).

Like :mod:`megatron_hcp.patching.cpu_runtime` for megatron-core: named, version-gated,
revertible registry patches (``megatron-hcp patch list`` shows them under megatron-bridge), most
of them giving *one* Bridge module a CPU view of ``torch`` (inside it ``torch.cuda`` calls are
answered for the CPU; nothing else in the process changes). Bridge's own functions run
unchanged otherwise. Apply with :func:`apply_bridge_cpu_runtime` for a run on the CPU (whatever
the machine has), after ``megatron_hcp.patching.apply_cpu_runtime(training=True)`` for megatron-core
(its ``cpu-timers``, ``cpu-dist-checkpointing`` and ``cpu-ddp-wrap`` are what Bridge's loop
reaches beyond the project's own trainer).

:data:`BRIDGE_RUNTIME_PATCHES` are not about the CPU: what Bridge's loop needs wherever it runs
on megatron-core's wheel (its prebuilt dataset helpers); ``prepare_environment`` applies them on
every device.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from ..parallel_state.groups import DefaultBackendDistributed
from ..patching.cpu_runtime import CpuDeviceTorch, _CpuCuda, _CudaMoveStaysOnCpu
from ..patching.registry import Patch, Target, apply, revert

__all__ = ["BRIDGE_CPU_RUNTIME_PATCHES", "BRIDGE_RUNTIME_PATCHES", "apply_bridge_cpu_runtime",
           "revert_bridge_cpu_runtime"]

_PKG = "megatron.bridge"
# Bridge releases these patches were written and run against (on megatron-core 0.19.2)
VERSIONS = ("0.6.2",)


class _OneCpuDevice(_CpuCuda):
    """``torch.cuda`` for Bridge's initialization: the CPU is this rank's one device, so Bridge
    seeds megatron's model-parallel RNG tracker (CPU generator under megatron-hcp's CPU runtime)
    and builds decentralized groups, as it does with one GPU per rank."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        pass


class _InitializeTorch(CpuDeviceTorch):
    def __init__(self, real: Any):
        super().__init__(real)
        self.cuda = _OneCpuDevice(real.cuda)
        self.distributed = DefaultBackendDistributed(real.distributed)


def _make_grid_on_default_backend(original):
    class HyperCommGrid(original):
        """megatron's ``HyperCommGrid`` as Bridge's decentralized path builds it, on the default
        backend instead of the ``backend="nccl"`` Bridge passes (gloo on the CPU)."""

        def __init__(self, shape, dim_names, rank_offset=0, backend=None):
            super().__init__(shape, dim_names, rank_offset, backend=None)

    return HyperCommGrid


def _make_initialize_megatron(original):
    @functools.wraps(original)
    def initialize_megatron(cfg, allow_no_cuda=False, *args, **kwargs):
        """Bridge's, with ``allow_no_cuda=True`` (the CPU runtime is in effect)."""
        return original(cfg, True, *args, **kwargs)

    return initialize_megatron


def _make_warmup_keeps_cpu_rng(original):
    @functools.wraps(original)
    def _warmup_jit_function(*args, **kwargs):
        """Bridge's, with the CPU generator's state restored afterwards: on a GPU its random
        warm-up tensors (shaped by the CP size) and their dropout draw from the CUDA generator,
        which parameter initialization on the CPU never reads; on the CPU they would shift the
        generator that initializes the model, so weights would depend on the CP layout. The
        functions run eagerly: the warm-up exists to compile GPU fusions before the first step,
        and compiling them for the CPU (inductor, seconds a rank) buys nothing there (a fusion
        the model uses still compiles on its first call)."""
        with torch.random.fork_rng(devices=[]), torch.compiler.set_stance("force_eager"):
            return original(*args, **kwargs)

    return _warmup_jit_function


def _make_compile_helpers(original):
    @functools.wraps(original)
    def compile_helpers():
        """megatron-core's, unless its prebuilt dataset helpers already import (wheels ship
        ``helpers_cpp`` compiled and no Makefile, so ``make`` fails and Bridge exits)."""
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            original()

    return compile_helpers


def _make_get_model(original):
    @functools.wraps(original)
    def get_model(model_provider, ddp_config, *args, **kwargs):
        """Bridge's, with ``use_cpu_initialization=True``: parameters are created on the CPU
        and the model is not moved to a GPU (Bridge's ``setup`` never sets it)."""
        kwargs["use_cpu_initialization"] = True
        return original(model_provider, ddp_config, *args, **kwargs)

    return get_model


def _make_moves_stay_on_cpu(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        """Bridge's, but ``Tensor.cuda()`` of a CPU tensor inside this call is the tensor."""
        with _CudaMoveStaysOnCpu():
            return original(*args, **kwargs)

    return wrapper


def _views(name: str, summary: str, upstream: str, modules: tuple[str, ...]) -> Patch:
    """A CPU view of ``torch`` for each of these Bridge modules."""
    return Patch(name=name, summary=summary, upstream=upstream, versions=VERSIONS,
                 targets=tuple(Target(f"{_PKG}.{m}", "torch", CpuDeviceTorch) for m in modules),
                 category="cpu-runtime", package="megatron-bridge")


# what Bridge's loop needs on every device with megatron-core's wheel (GPU runs included)
BRIDGE_RUNTIME_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-prebuilt-dataset-helpers",
        summary="initialize_megatron uses megatron-core's prebuilt dataset helpers instead of "
        "running make (the wheel has no Makefile: Bridge exits)",
        upstream="megatron/bridge/training/initialize.py:147 compile_helpers() (megatron-core "
        "datasets/utils.py:20-30 runs make in the installed package and sys.exit(1) on failure)",
        versions=VERSIONS,
        targets=(Target(f"{_PKG}.training.initialize", "compile_helpers",
                        _make_compile_helpers),),
        category="integration", package="megatron-bridge",
    ),
)

BRIDGE_CPU_RUNTIME_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="bridge-cpu-initialize",
        summary="initialize_megatron runs without CUDA (allow_no_cuda) and treats the CPU as "
        "the rank's one device: RNG tracker seeded, decentralized groups allowed and built on "
        "the default backend (gloo), the JIT warm-up's random draws kept off the CPU generator",
        upstream="megatron/bridge/training/initialize.py:89-91 assert torch.cuda.is_available(); "
        "763-765 RuntimeError for use_decentralized_pg with device_count()==0; 869 "
        "model_parallel_cuda_manual_seed only when device_count()>0; 431-520 "
        "_create_pg_collection: HyperCommGrid(..., backend='nccl') and "
        "new_subgroups_by_enumeration with backend='nccl'; 886-956 _warmup_jit_function draws "
        "random 'cuda' tensors of seq_length // context_parallel_size rows (and dropout)",
        versions=VERSIONS,
        targets=(
            Target(f"{_PKG}.training.initialize", "initialize_megatron",
                   _make_initialize_megatron, params=("cfg", "allow_no_cuda"),
                   also_bound_under=_PKG),
            Target(f"{_PKG}.training.initialize", "torch", _InitializeTorch),
            Target(f"{_PKG}.training.initialize", "HyperCommGrid",
                   _make_grid_on_default_backend),
            Target(f"{_PKG}.training.initialize", "_warmup_jit_function",
                   _make_warmup_keeps_cpu_rng),
        ),
        category="cpu-runtime", package="megatron-bridge",
    ),
    _views("bridge-cpu-setup", "setup's start-time all-reduce on the CPU",
           "megatron/bridge/training/setup.py:312 torch.tensor(..., device='cuda')",
           ("training.setup",)),
    Patch(
        name="bridge-cpu-model-init",
        summary="model parameters are created on the CPU and stay there",
        upstream="megatron/bridge/models/model_provider.py:646 get_model sets "
        "use_cpu_initialization=False unless asked, then 683-689 model_module.cuda()",
        versions=VERSIONS,
        targets=(Target(f"{_PKG}.models.model_provider", "get_model", _make_get_model,
                        params=("model_provider", "ddp_config"), also_bound_under=_PKG),),
        category="cpu-runtime", package="megatron-bridge",
    ),
    Patch(
        name="bridge-cpu-data",
        summary="batches stay on the CPU; the data-iterator flags are broadcast from the CPU",
        upstream="megatron/bridge/training/gpt_step.py:282 val.cuda(non_blocking=True) in "
        "get_batch_from_iterator; data/loaders.py:250,406 flags on device='cuda'",
        versions=VERSIONS,
        targets=(
            Target(f"{_PKG}.training.gpt_step", "get_batch_from_iterator",
                   _make_moves_stay_on_cpu, also_bound_under=_PKG),
            Target(f"{_PKG}.data.loaders", "torch", CpuDeviceTorch),
        ),
        category="cpu-runtime", package="megatron-bridge",
    ),
    _views("bridge-cpu-train", "the training loop's CUDA cache, synchronize, flag and "
           "statistics tensors on the CPU",
           "megatron/bridge/training/train.py:934,973,1030,1329,1461; "
           "training/utils/train_utils.py:381-596,769,1210 device='cuda'; training/eval.py:"
           "260-314 torch.cuda.synchronize/empty_cache, device='cuda'; training/utils/"
           "flop_utils.py:147-153 the sequence statistics' all-reduce on "
           "torch.cuda.current_device() wherever CUDA is visible (a CPU run on a GPU machine "
           "would hand gloo a CUDA tensor)",
           ("training.train", "training.utils.train_utils", "training.eval",
            "training.utils.flop_utils")),
    _views("bridge-cpu-checkpointing", "checkpoint iteration flags and RNG state on the CPU",
           "megatron/bridge/training/checkpointing.py:326 device='cuda'; 491,3155,3167 "
           "torch.cuda.get_rng_state/set_rng_state; 3199 empty_cache",
           ("training.checkpointing",)),
)


def apply_bridge_cpu_runtime(force: bool = True) -> list[str]:
    """Apply :data:`BRIDGE_CPU_RUNTIME_PATCHES` for a run on the CPU, whatever the machine has
    (the caller decides by its run's device); ``force`` is accepted for old callers."""
    return apply(BRIDGE_CPU_RUNTIME_PATCHES)


def revert_bridge_cpu_runtime() -> list[str]:
    return revert(BRIDGE_CPU_RUNTIME_PATCHES)
