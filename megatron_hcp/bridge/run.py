"""Megatron-Bridge's own training loop with megatron-hcp: set-up and a metrics recorder.

:func:`prepare_environment` readies a process for Bridge's ``pretrain`` / ``finetune``:
import-only stand-ins where Transformer Engine / nvidia-resiliency-ext are missing
(:mod:`.import_shims`), what Bridge's loop needs on megatron-core's wheel, megatron-core's and
Bridge's CPU runtimes for a run on the CPU, and
:func:`megatron_hcp.bridge.install`. :func:`metrics_recorder` is a Bridge callback that records,
per training step, what the functional checks compare: lm loss, grad norm, the gradient's zero
count, the step time and, with dynamic CP, the plan's micro-batches and groups - gathered over
every rank at the end of training (Bridge may destroy the process group it created right after).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["prepare_environment", "metrics_recorder"]

_BRIDGE_LOOP = ("megatron.bridge.training.pretrain", "megatron.bridge.training.finetune",
                "megatron.bridge.training.gpt_step")


def prepare_environment(cpu: bool | None = None) -> list[str]:
    """Make this process ready to run Bridge's loop with megatron-hcp; return what it applied
    (stand-ins and patch names). ``cpu``: apply the CPU runtimes (default: when CUDA is
    unavailable)."""
    import importlib

    import megatron.core  # noqa: F401  (megatron decides HAVE_TE before any stand-in exists)
    import megatron.core.extensions.transformer_engine  # noqa: F401

    from ..patching import apply, apply_cpu_runtime
    from ..patching.hybrid import HYBRID_PATCHES
    from ..patching.mla import apply_mla_cpu_runtime
    from . import import_shims
    from .cpu_runtime import BRIDGE_RUNTIME_PATCHES, apply_bridge_cpu_runtime
    from .hook import install

    done = [f"import-only {name}" for name in import_shims.install()]
    # Bridge logs each optional import it probes and misses (e.g. TE's FP8 pieces) with a whole
    # traceback at INFO; those are no errors of the run
    logging.getLogger("megatron.bridge.utils.import_utils").setLevel(logging.WARNING)
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    if cpu:
        done += apply_cpu_runtime(training=True) + apply_mla_cpu_runtime()
    # on every device: the hybrid stack's final norm is TENorm where TE imports, a torch norm
    # where it does not (a GPU machine without TE too)
    done += apply(p for p in HYBRID_PATCHES if p.supports())
    for module in _BRIDGE_LOOP:
        importlib.import_module(module)
    done += apply(BRIDGE_RUNTIME_PATCHES)  # on every device (the wheel's dataset helpers)
    if cpu:
        done += apply_bridge_cpu_runtime()
    install()
    return done


def _dynamic_record(model: Any) -> dict[str, Any] | None:
    from megatron.core.utils import get_model_config

    from .dynamic_cp import dynamic_cp_steps

    steps = dynamic_cp_steps(get_model_config(model[0]))
    return steps[-1] if steps else None


def metrics_recorder(progress: Any = None) -> Any:
    """A Bridge ``Callback`` recording the per-step metrics (module docstring); after training
    its ``history`` holds, on every rank, the lists ``loss``, ``grad_norm``, ``num_zeros``,
    ``iteration_time``, ``micro_batches`` and ``dynamic_cp`` (the step's plan record, or None
    without dynamic CP). ``progress(step, row)`` is called after each step on the last rank (it
    is on the last pipeline stage, which has the loss)."""
    from megatron.bridge.training.callbacks import Callback

    class MetricsRecorder(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.history: dict[str, list] = {}
            self._started = 0.0

        def on_train_step_start(self, context: Any) -> None:
            self._started = time.perf_counter()

        def on_train_step_end(self, context: Any) -> None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            loss = (context.loss_dict or {}).get("lm loss")
            count_zeros = getattr(context.optimizer, "count_zeros", None)
            dynamic = _dynamic_record(context.model)
            self.rows.append({
                "loss": None if loss is None else float(loss),
                "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                # megatron's own count (a collective over the model-parallel group)
                "num_zeros": float(count_zeros()) if count_zeros is not None else None,
                "iteration_time": time.perf_counter() - self._started,
                # the plan's count under dynamic CP, else Bridge's calculator's
                "micro_batches": dynamic["micro_batches"] if dynamic else get_num_microbatches(),
                "dynamic_cp": dynamic,
            })
            if progress is not None and dist.get_rank() == dist.get_world_size() - 1:
                progress(len(self.rows), self.rows[-1])

        def on_train_end(self, context: Any) -> None:
            rows: list = [None] * dist.get_world_size()
            dist.all_gather_object(rows, self.rows)  # this job's own ranks
            self.history = merge_rank_rows(rows)

    return MetricsRecorder()


def merge_rank_rows(per_rank: list[list[dict[str, Any]]]) -> dict[str, list]:
    """One history from every rank's rows: the loss from the rank that has it (the last
    pipeline stage), everything else from rank 0 (the same on every rank)."""
    steps = len(per_rank[0])
    if any(len(rows) != steps for rows in per_rank):
        raise RuntimeError(f"ranks recorded different step counts: {[len(r) for r in per_rank]}")
    keys = ("grad_norm", "num_zeros", "iteration_time", "micro_batches", "dynamic_cp")
    history: dict[str, list] = {k: [] for k in ("loss", *keys)}
    for step in range(steps):
        losses = [rows[step]["loss"] for rows in per_rank if rows[step]["loss"] is not None]
        history["loss"].append(losses[0] if losses else None)
        for key in keys:
            history[key].append(per_rank[0][step][key])
    return history
