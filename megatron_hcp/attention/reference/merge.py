"""The LSE merge of one block's partial attention into a rank's running output: eager or fused.

Every block of CP attention gives its query rows an output and an LSE. A later block's share of
a row is ``w = exp(lse_blk - logaddexp(lse, lse_blk)) = sigmoid(lse_blk - lse)``; the row
becomes ``lerp(out, out_blk, w)`` and its LSE ``logaddexp(lse, lse_blk)``. The first block of
a row is copied in (what the merge gives on an output of 0 and an LSE of ``-inf``).

* **eager** - four kernels a merge (sub, sigmoid, lerp, logaddexp), one more where a block may
  have rows that see no key (their ``w`` is NaN: set to 0), one more where the block output is
  in half precision (its conversion to the fp32 accumulator), and a gather and two scatters
  where the block's rows are an index (a window's trimmed rows).
* **fused** - the same ops compiled by ``torch.compile`` (inductor) into one kernel a merge
  (Triton on CUDA, C++ on the CPU), the gather and scatters included; shapes are dynamic, so
  a new block size does not compile again. The first call in a process compiles (seconds).

``MEGATRON_HCP_FUSED_MERGE`` chooses, read at every call (:func:`merge_mode` validates it):

* ``auto`` (the default) - fused on CUDA where Triton and a C compiler (which Triton builds
  its launcher with) are found, eager elsewhere. Should the first compile fail all the same,
  the merge warns once, naming the error, and stays eager in this process: a faster merge is
  never a reason to stop training;
* ``on`` - fused on every device (the CPU needs a C++ compiler, as inductor does); a compile
  error is raised;
* ``off`` - eager everywhere (where ``torch.compile`` is not wanted).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.fx.experimental._config

from .blocks import record_merge
from .seq_layout import CPAttentionError

__all__ = ["FUSED_MERGE_ENV", "MERGE_MODES", "fuses", "merge_into", "merge_mode", "merging"]

FUSED_MERGE_ENV = "MEGATRON_HCP_FUSED_MERGE"
MERGE_MODES = ("auto", "on", "off")


def merge_mode() -> str:
    """``MEGATRON_HCP_FUSED_MERGE`` (default ``auto``), checked against :data:`MERGE_MODES`."""
    value = os.environ.get(FUSED_MERGE_ENV, "auto")
    mode = value.strip().lower()
    if mode not in MERGE_MODES:
        raise CPAttentionError(
            f"{FUSED_MERGE_ENV}={value!r}: use auto (the default: the merge of partial "
            "attention outputs is fused where Triton runs), on (fused on every device; the CPU "
            "needs a C++ compiler) or off (eager); unset it for auto")
    return mode


@contextlib.contextmanager
def merging(mode: str) -> Iterator[None]:
    """``MEGATRON_HCP_FUSED_MERGE`` set to ``mode`` inside the block, as it was after it (the
    benchmarks measure both merges in one run)."""
    if mode not in MERGE_MODES:
        raise CPAttentionError(f"merge mode {mode!r}: use one of {', '.join(MERGE_MODES)}")
    before = os.environ.get(FUSED_MERGE_ENV)
    os.environ[FUSED_MERGE_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[FUSED_MERGE_ENV]
        else:
            os.environ[FUSED_MERGE_ENV] = before


@functools.cache
def _triton_runs() -> bool:
    """Triton imports, sees a CUDA GPU it supports, and finds the C compiler it builds its
    launcher with (``$CC``, else gcc or clang: Triton's own search)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    return bool(has_triton()) and compiler is not None


def fuses(device: torch.device) -> bool:
    """Whether merges of accumulators on ``device`` take the fused kernel (module docstring)."""
    mode = merge_mode()
    if mode == "auto":
        return device.type == "cuda" and _triton_runs() and not _compiled().failed
    return mode == "on"


def _merge_rows(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor,
                lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """Merge a block into the rows ``out`` [B,H,R,Dv], ``lse`` [B,H,R] (views of the
    accumulators, written in place)."""
    lse_b = lse_blk.to(lse.dtype)
    w = torch.sigmoid(lse_b - lse)
    if empty_rows:  # rows no key reached yet, before and in this block (-inf - -inf): out 0
        w = w.nan_to_num_(nan=0.0)
    out.lerp_(out_blk.to(out.dtype), w.unsqueeze(-1))
    if torch.compiler.is_compiling():  # dynamo takes no out=; the copy fuses into the kernel
        lse.copy_(torch.logaddexp(lse, lse_b))
    else:
        torch.logaddexp(lse, lse_b, out=lse)


def _merge_index(out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: torch.Tensor,
                 out_blk: torch.Tensor, lse_blk: torch.Tensor, empty_rows: bool) -> None:
    """Merge a block into the accumulator rows ``rows`` (an index): gather, merge, scatter."""
    out, lse = out_acc.index_select(2, rows), lse_acc.index_select(2, rows)
    _merge_rows(out, lse, out_blk, lse_blk, empty_rows)
    out_acc.index_copy_(2, rows, out)
    lse_acc.index_copy_(2, rows, lse)


# What torch.compile compiles: one function (one code object, so one cache of compiled
# variants, each dtype pair one of them) per kind of rows and per empty_rows
def _fused_rows_dense(*args) -> None:
    _merge_rows(*args, False)


def _fused_rows_masked(*args) -> None:
    _merge_rows(*args, True)


def _fused_index_dense(*args) -> None:
    _merge_index(*args, False)


def _fused_index_masked(*args) -> None:
    _merge_index(*args, True)


_FUSED = {("rows", False): _fused_rows_dense, ("rows", True): _fused_rows_masked,
          ("index", False): _fused_index_dense, ("index", True): _fused_index_masked}


class _Compiled:
    """The fused merges of this process (compiled on first use) and whether ``auto`` found
    that they cannot compile here. Calls hold a lock: ranks that are threads of one process
    (tests/gpu) would otherwise compile and look up the same cache at once, which dynamo
    does not expect (it recompiles until its limit)."""

    def __init__(self) -> None:
        self.failed = False
        self._fns: dict[tuple[str, bool], Callable[..., None]] = {}
        self._worked = False
        self._at_limit = False
        self._lock = threading.Lock()

    def _fn(self, key: tuple[str, bool]) -> Callable[..., None]:
        if key not in self._fns:
            self._fns[key] = torch.compile(_FUSED[key], dynamic=True, fullgraph=True)
        return self._fns[key]

    def _call(self, fn: Callable[..., None], args: tuple) -> None:
        """``fn(*args)`` as every merge is compiled: one thread at a time, without autograd
        (a merge is never differentiated: it runs in the attention's forward) and without
        duck sizing (sizes, strides and offsets that happen to be equal in the first call are
        not assumed equal, which would compile again for every other block shape)."""
        shapes = torch.fx.experimental._config
        with self._lock, torch.no_grad():
            duck = shapes.use_duck_shape
            shapes.use_duck_shape = False
            try:
                fn(*args)
            finally:
                shapes.use_duck_shape = duck

    def run(self, key: tuple[str, bool], *args) -> bool:
        """Run the compiled merge ``key`` (``"rows"`` or ``"index"``, ``empty_rows``);
        ``False``: merge this call eagerly - ``auto``'s first compile in this process failed,
        or dynamo's recompile limit for this merge is reached (both warned once)."""
        try:
            self._call(self._fn(key), args)
        except Exception as err:  # noqa: BLE001 - compile errors come in many types
            if _at_recompile_limit(err):
                if not self._at_limit:
                    self._at_limit = True
                    warnings.warn(
                        "megatron-hcp: the fused LSE merge reached torch._dynamo's recompile "
                        "limit (a compiled variant per dtype pair and special shape); merges "
                        "of further variants run eagerly (correct, slower)",
                        RuntimeWarning, stacklevel=3)
                return False
            if self._worked or merge_mode() == "on":
                raise
            self.failed = True
            warnings.warn(
                f"megatron-hcp: the fused LSE merge did not compile here ({type(err).__name__}: "
                f"{err}); CP attention merges eagerly in this process (correct, slower). Set "
                f"{FUSED_MERGE_ENV}=off to skip the attempt, or =on to raise the error",
                RuntimeWarning, stacklevel=3)
            return False
        self._worked = True
        return True


def _at_recompile_limit(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is dynamo refusing another compiled variant."""
    while err is not None:
        text = f"{type(err).__name__} {err}".lower()
        if "recompilelimit" in text or "recompile limit" in text or "recompile_limit" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


@functools.cache
def _compiled() -> _Compiled:
    return _Compiled()


def merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    rows: slice | torch.Tensor,
    out_blk: torch.Tensor,
    lse_blk: torch.Tensor,
    *,
    first: bool = False,
    empty_rows: bool = True,
) -> None:
    """Merge a block result into the running (out, lse) at query ``rows`` (in place).

    ``out_acc`` [B,H,S,Dv] and ``lse_acc`` [B,H,S] are in the accumulation dtype. ``first``: no
    block was merged into ``out_acc`` yet (out 0, LSE ``-inf`` everywhere), so the block is
    copied in - exactly what the merge gives. Otherwise the module docstring's merge, eager or
    fused (:func:`fuses`; counted in every active :class:`~.blocks.BlockCounter`).
    ``empty_rows``: the block may have rows that see no key (LSE ``-inf``: a mask, or a bias
    with ``-inf``); without it every row of the block saw a key (dense blocks), and no row can
    turn to NaN.
    """
    if first:  # a copy converts the dtype on the way
        if isinstance(rows, slice):
            out_acc[:, :, rows].copy_(out_blk)
            lse_acc[:, :, rows].copy_(lse_blk)
        else:
            out_acc.index_copy_(2, rows, out_blk.to(out_acc.dtype))
            lse_acc.index_copy_(2, rows, lse_blk.to(lse_acc.dtype))
        return
    if isinstance(rows, slice):
        name, args = "rows", (out_acc[:, :, rows], lse_acc[:, :, rows], out_blk, lse_blk)
    else:
        name, args = "index", (out_acc, lse_acc, rows, out_blk, lse_blk)
    if fuses(out_acc.device) and _compiled().run((name, empty_rows), *args):
        record_merge("fused")
        return
    (_merge_rows if name == "rows" else _merge_index)(*args, empty_rows)
    record_merge("eager")
