"""CPU/gloo runtime for megatron-core: what it needs to build and train GPT models without CUDA.

Most CUDA references in megatron-core sit inside large functions (schedules, p2p communication,
DDP buffers). Rather than rewriting those, each patch gives *one upstream module* a CPU view of
``torch`` (:class:`CpuDeviceTorch`): inside that module, ``torch.cuda.current_device()`` is the
CPU device, tensor factories asked for ``device="cuda"`` allocate on the CPU, CUDA streams and
``synchronize`` are no-ops and the CUDA RNG is the CPU generator. Nothing else in the process
sees a changed torch. Small functions that index with pinned/CUDA tensors are replaced; the one
``Tensor.cuda()`` call on a tied weight is answered inside that call by a torch function mode.

Apply with :func:`apply_cpu_runtime` for a run on the CPU - whatever the machine has: a CPU run
on a machine with GPUs needs it as much as one without, and must never touch CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .registry import Patch, Target, apply, revert

__all__ = ["CPU_RUNTIME_PATCHES", "TRAINING_CPU_RUNTIME_PATCHES", "CpuDeviceTorch",
           "apply_cpu_runtime", "revert_cpu_runtime"]

VERSIONS = ("0.16.1", "0.19.2")
_FACTORIES = frozenset(
    "empty zeros ones full tensor as_tensor arange rand randn randint randperm eye linspace "
    "empty_like zeros_like ones_like full_like".split()
)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class _NoStream:
    """Stand-in for a CUDA stream/event on the CPU: ordering is already sequential."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module."""

    Stream = _NoStream
    Event = _NoStream

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def default_stream(*args: Any) -> _NoStream:
        return _NoStream()

    current_stream = default_stream

    @staticmethod
    def get_rng_state(*args: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)


class CpuDeviceTorch:
    """The ``torch`` module as one megatron-core module sees it under the CPU runtime."""

    def __init__(self, real: Any):
        self._real = real
        self.cuda = _CpuCuda(real.cuda)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        return _factory_on_cpu(attr) if name in _FACTORIES else attr


def _torch_view(module: str, upstream: str, name: str, summary: str) -> Patch:
    return Patch(
        name=name,
        summary=summary,
        upstream=upstream,
        versions=VERSIONS,
        targets=(Target(module, "torch", CpuDeviceTorch),),
        category="cpu-runtime",
    )


def _make_pos_emb_on_cp_rank(original):
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """The positional embedding of this CP rank's two chunks (no pinned/CUDA index)."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=pos_emb.device)
        chunked = pos_emb.view(
            *pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :]
        )
        mine = chunked.index_select(seq_dim, index)
        return mine.view(*mine.shape[:seq_dim], -1, *mine.shape[seq_dim + 2 :])

    return get_pos_emb_on_this_cp_rank


def _make_rng_get(original):
    def _get_cuda_rng_state(device=-1, clone=False, graph_safe=False):
        """The 'device' RNG state is the CPU generator's under the CPU runtime."""
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _make_rng_set(original):
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


class _CudaMoveStaysOnCpu(TorchFunctionMode):
    """Inside this mode ``Tensor.cuda()`` of a CPU tensor is the tensor itself (this thread, this
    call only; nothing in ``torch`` is replaced)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda and args and args[0].device.type == "cpu":
            return args[0]
        return func(*args, **(kwargs or {}))


def _make_embedding_sync(original):
    def setup_embeddings_and_output_layer(self):
        """Upstream, but the tied-embedding all-reduce runs where the weight lives: upstream
        moves the shared weight with ``weight.data.cuda()`` first; during this call only, that
        move of a CPU tensor is the identity (a torch function mode, no process-wide change)."""
        with _CudaMoveStaysOnCpu():
            return original(self)

    return setup_embeddings_and_output_layer


def _make_split_sizes_as_on_a_gpu(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        """Upstream's, and a CPU tensor asked for ``as_numpy`` becomes a NumPy array too (a
        copy, as upstream's device-to-host copy is): on a GPU the alltoall dispatcher's split
        sizes reach ``all_to_all_single`` as NumPy arrays made here; on the CPU upstream skips
        them (not CUDA), and tensors as split sizes are refused by torch's binding
        (``TypeError``)."""
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy().copy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _make_router_gating_without_te(original):
    def router_gating_linear(inp, weight, bias, router_dtype):
        """Upstream's where Transformer Engine imports; without it, upstream's own torch branch
        (the logits in ``router_dtype``; autograd casts the gradients back as upstream's
        backward does): 0.16.1's ``moe_utils`` leaves ``te_general_gemm`` undefined when TE
        is absent, so its gating raises ``NameError``."""
        from megatron.core.transformer.moe import moe_utils

        if "te_general_gemm" in vars(moe_utils):
            return original(inp, weight, bias, router_dtype)
        shape = inp.shape
        out = torch.nn.functional.linear(
            inp.reshape(-1, shape[-1]).to(router_dtype), weight.to(router_dtype),
            None if bias is None else bias.to(router_dtype))
        return out.view(*shape[:-1], -1)

    return router_gating_linear


class _AbsentTELinear:
    """Stands for TE's ``TELinear`` where Transformer Engine is absent: nothing is one."""


def _mla_te_linear(original: Any) -> Any:
    """``multi_latent_attention.TELinear``: the real class with TE, else a class no layer is an
    instance of (megatron's TE extension gives a MagicMock, which ``isinstance`` rejects)."""
    from megatron.core.extensions import transformer_engine as te_ext

    return original if getattr(te_ext, "HAVE_TE", False) else _AbsentTELinear


_ROPE = "megatron.core.models.common.embeddings"
_MOE = "megatron.core.transformer.moe"

CPU_RUNTIME_PATCHES: tuple[Patch, ...] = (
    _torch_view(
        "megatron.core.pipeline_parallel.schedules",
        "megatron/core/pipeline_parallel/schedules.py:596,2138 torch.zeros(..., device='cuda')",
        "cpu-schedules-device",
        "pipeline schedules allocate their token counters on the CPU",
    ),
    _torch_view(
        "megatron.core.pipeline_parallel.p2p_communication",
        "megatron/core/pipeline_parallel/p2p_communication.py:190-202,242,313,321,398 "
        "torch.cuda.current_device() buffers and torch.cuda.synchronize()",
        "cpu-p2p-device",
        "pipeline p2p receive buffers on the CPU; CUDA synchronize is a no-op",
    ),
    _torch_view(
        "megatron.core.utils",
        "megatron/core/utils.py:631 GlobalMemoryBuffer.get_tensor torch.cuda.current_device()",
        "cpu-global-memory-buffer",
        "the global memory buffer allocates on the CPU",
    ),
    _torch_view(
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron/core/distributed/param_and_grad_buffer.py:417,422,529 CUDA streams; "
        "768-806 buffers on torch.cuda.current_device()",
        "cpu-ddp-buffers",
        "DDP parameter/gradient buffers on the CPU; communication streams are no-ops",
    ),
    _torch_view(
        f"{_ROPE}.rotary_pos_embedding",
        "megatron/core/models/common/embeddings/rotary_pos_embedding.py:162 "
        "inv_freq.to(torch.cuda.current_device())",
        "cpu-rope-device",
        "RoPE frequencies stay on the CPU",
    ),
    _torch_view(
        "megatron.core.transformer.utils",
        "megatron/core/transformer/utils.py:35,41 causal / sliding-window masks on device='cuda' "
        "(also reached through fusions/fused_softmax, which imports them by value)",
        "cpu-attention-masks",
        "default causal and sliding-window masks on the CPU",
    ),
    _torch_view(
        "megatron.core.optimizer.optimizer",
        "megatron/core/optimizer/optimizer.py:473,481,485,907,1141 scalars on device='cuda'",
        "cpu-optimizer-device",
        "optimizer loss-scale and overflow scalars on the CPU",
    ),
    _torch_view(
        "megatron.core.optimizer.clip_grads",
        "megatron/core/optimizer/clip_grads.py:90,103,115,174,207 norms and counters on "
        "device='cuda'",
        "cpu-grad-norm-device",
        "gradient norm and zero counting on the CPU",
    ),
    _torch_view(
        "megatron.core.transformer.multi_token_prediction",
        "megatron/core/transformer/multi_token_prediction.py:337 MTPLossLoggingHelper "
        "tracker on torch.cuda.current_device()",
        "cpu-mtp-loss-tracker",
        "the multi-token-prediction loss tracker lives on the CPU",
    ),
    Patch(
        name="cpu-sequence-parallel",
        summary="sequence-parallel all-gather and reduce-scatter buffers on the CPU",
        upstream="megatron/core/tensor_parallel/mappings.py:91,141,148,181,442 and "
        "layers.py:552 (LinearWithGradAccumulationAndAsyncCommunication.backward) buffers on "
        "torch.cuda.current_device()",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.tensor_parallel.mappings", "torch", CpuDeviceTorch),
            Target("megatron.core.tensor_parallel.layers", "torch", CpuDeviceTorch),
        ),
        category="cpu-runtime",
    ),
    Patch(
        name="cpu-rope-cp-index",
        summary="RoPE CP slicing without pinned memory or .cuda()",
        upstream="megatron/core/models/common/embeddings/rope_utils.py:62-64 "
        "get_pos_emb_on_this_cp_rank (imported by value in rotary_pos_embedding.py and "
        "yarn_rotary_pos_embedding.py)",
        versions=VERSIONS,
        targets=(
            Target(f"{_ROPE}.rope_utils", "get_pos_emb_on_this_cp_rank",
                   _make_pos_emb_on_cp_rank),
            Target(f"{_ROPE}.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
                   _make_pos_emb_on_cp_rank),
            Target(f"{_ROPE}.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
                   _make_pos_emb_on_cp_rank),
        ),
        category="cpu-runtime",
    ),
    Patch(
        name="cpu-rng-tracker",
        summary="the model-parallel RNG tracker keeps its streams in the CPU generator",
        upstream="megatron/core/tensor_parallel/random.py:235-242 CudaRNGStatesTracker.add/fork "
        "(torch.cuda.get_rng_state / manual_seed, _get_cuda_rng_state, _set_cuda_rng_state)",
        versions=VERSIONS,
        targets=(
            Target("megatron.core.tensor_parallel.random", "torch", CpuDeviceTorch),
            Target("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _make_rng_get),
            Target("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _make_rng_set),
        ),
        category="cpu-runtime",
    ),
    Patch(
        name="mla-without-te",
        summary="multi-latent attention builds without Transformer Engine (TELinear is a class "
        "no layer is an instance of, not the TE extension's MagicMock)",
        upstream="megatron/core/transformer/multi_latent_attention.py:53-65 HAVE_TE = True "
        "whenever megatron's TE extension imports (it also imports without TE, with MagicMock "
        "classes), so MLASelfAttention.__init__ (185) raises on isinstance(linear_proj, TELinear)",
        versions=("0.16.1",),
        fixed_in="0.17.0",
        targets=(
            Target("megatron.core.transformer.multi_latent_attention", "TELinear",
                   _mla_te_linear),
        ),
        category="cpu-runtime",
    ),
    _torch_view(
        "megatron.core.timers",
        "megatron/core/timers.py:152,165 torch.cuda.synchronize() in _Timer.start/stop; 303 "
        "timings gathered on torch.cuda.current_device()",
        "cpu-timers",
        "megatron's timers synchronize nothing and gather their timings on the CPU",
    ),
    Patch(
        name="cpu-dist-checkpointing",
        summary="megatron's distributed checkpointing saves and loads from the CPU: no CUDA "
        "synchronize, flags and exchange buffers on the CPU",
        upstream="megatron/core/dist_checkpointing/strategies/filesystem_async.py:248, "
        "fully_parallel.py:287,296, async_utils.py:224,273,698 torch.cuda.synchronize / "
        "current_device(); state_dict_saver.py:204,252 and exchange_utils.py:103,109,329 "
        "device='cuda'",
        versions=VERSIONS,
        targets=tuple(Target(f"megatron.core.dist_checkpointing.{module}", "torch",
                             CpuDeviceTorch)
                      for module in ("strategies.filesystem_async", "strategies.fully_parallel",
                                     "strategies.async_utils", "strategies.state_dict_saver",
                                     "exchange_utils")),
        category="cpu-runtime",
    ),
    Patch(
        name="cpu-tied-embedding-sync",
        summary="PP>1 tied embeddings are all-reduced where they live",
        upstream="megatron/core/models/common/language_module/language_module.py:244 "
        "weight.data.cuda()",
        versions=VERSIONS,
        targets=(
            Target(
                "megatron.core.models.common.language_module.language_module",
                "LanguageModule.setup_embeddings_and_output_layer",
                _make_embedding_sync,
            ),
        ),
        category="cpu-runtime",
    ),
    _torch_view(
        f"{_MOE}.router",
        "megatron/core/transformer/moe/router.py:90-92 Router.gating moves the weight and bias "
        "to torch.cuda.current_device(); 164-198 expert-bias and global aux-loss buffers on it "
        "(0.19.2: 98-100, 180-247)",
        "cpu-moe-router-device",
        "the MoE router's weight, bias and token-count buffers stay on the CPU",
    ),
    Patch(
        name="moe-router-gating-without-te",
        summary="the MoE router's gating runs without Transformer Engine (upstream's torch "
        "branch instead of a NameError)",
        upstream="megatron/core/transformer/moe/moe_utils.py:24-39 imports te_general_gemm "
        "only where TE imports and defines no fallback, 1192 and 1225 read it: "
        "router_gating_linear (router.py:100) raises NameError without TE (0.19.2 defines "
        "None fallbacks: nothing to change)",
        versions=VERSIONS,
        targets=(Target(f"{_MOE}.router", "router_gating_linear",
                        _make_router_gating_without_te, versions=("0.16.1",),
                        params=("inp", "weight", "bias", "router_dtype")),),
        category="cpu-runtime",
    ),
    Patch(
        name="cpu-moe-alltoall-dispatcher",
        summary="the MoE alltoall dispatcher runs on the CPU: its device-to-host stream is a "
        "no-op and its split sizes reach all_to_all_single as NumPy arrays, as on a GPU",
        upstream="megatron/core/transformer/moe/token_dispatcher.py:445 torch.cuda.Stream(); "
        "871-893 _maybe_dtoh_and_synchronize: maybe_move_tensor_to_cpu(..., as_numpy=True) "
        "turns only CUDA tensors into NumPy split sizes (moe_utils.py:1093), CPU tensors stay "
        "tensors, which tensor_parallel/mappings.py:_AllToAll hands to all_to_all_single "
        "(TypeError) (0.19.2: 469, 913-947)",
        versions=VERSIONS,
        targets=(
            Target(f"{_MOE}.token_dispatcher", "torch", CpuDeviceTorch),
            Target(f"{_MOE}.token_dispatcher", "maybe_move_tensor_to_cpu",
                   _make_split_sizes_as_on_a_gpu,
                   params=("tensor", "as_numpy", "record_stream")),
        ),
        category="cpu-runtime",
    ),
)


# megatron/training (Megatron-LM's training package, shipped in the megatron-core wheel from 0.19):
# only Megatron-Bridge's loop imports it (3-4 s), so it is patched on request
TRAINING_CPU_RUNTIME_PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu-ddp-wrap",
        summary="megatron's DDP wrapping of a model (megatron/training, used by "
        "Megatron-Bridge's model build) runs on the CPU: no CUDA stream",
        upstream="megatron/training/models/dist_utils.py:303-366 torch.cuda.Stream() and "
        "current_stream().wait_stream around the DDP wrap (0.19.2; 0.16.1 has no such module)",
        versions=VERSIONS,
        targets=(Target("megatron.training.models.dist_utils", "torch", CpuDeviceTorch,
                        versions=("0.19.2",)),),
        category="cpu-runtime",
    ),
)


def apply_cpu_runtime(force: bool = True, training: bool = False) -> list[str]:
    """Apply every CPU-runtime patch for a run on the CPU; return their names.

    The caller decides by its run's device, never by the machine: a CPU run on a machine with
    CUDA needs the CPU runtime too (without it megatron moves RoPE's frequencies to the GPU and
    forks the CUDA RNG). ``force`` is accepted for old callers and changes nothing.
    ``training``: also :data:`TRAINING_CPU_RUNTIME_PATCHES` (megatron/training)."""
    return apply(CPU_RUNTIME_PATCHES + (TRAINING_CPU_RUNTIME_PATCHES if training else ()))


def revert_cpu_runtime() -> list[str]:
    return revert(CPU_RUNTIME_PATCHES + TRAINING_CPU_RUNTIME_PATCHES)
