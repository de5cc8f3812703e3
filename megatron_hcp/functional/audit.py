"""Device audit of a recipe: its ``gpu_nccl`` training step on emulated CUDA devices, on the CPU.

``audit_recipe(recipe)`` starts the recipe's ranks as local processes joined over gloo and runs,
on each, one step of exactly what ``functional run --platform gpu_nccl`` runs there (the same
:func:`~.worker.train_recipe` / :func:`~.bridge_worker.train_bridge_recipe`, the same patches,
no CPU runtime): model build, forward, loss, backward, optimizer step and, with dynamic CP, the
data path - inside :func:`megatron_hcp.harness.virtual_cuda.virtual_cuda`, where ``cuda``
tensors hold their data on the CPU and every op that would mix devices on the GPU is recorded
with its file:line. Every rank runs, so every rank role (first / last pipeline stage, TP and CP
ranks, idle dynamic-CP positions) is audited at once; the ranks' collectives are real.
``platform="cpu_gloo"`` audits the CPU run instead, on a machine whose torch reports CUDA: every
use of CUDA by the run's code is a finding.

The emulation changes the process for good (see :mod:`megatron_hcp.harness.virtual_cuda`): the audit
refuses a process where the CPU runtime patches are applied (they would hide the mixes) and
should run in ranks of its own (``audit_recipe`` starts them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..harness.virtual_cuda import DeviceMix

__all__ = ["AuditError", "AuditReport", "audit_rank", "audit_recipe"]

PLATFORM = "gpu_nccl"  # the platform whose run the audit replays


class AuditError(RuntimeError):
    """The audit cannot run here (one line: what, why, what to do)."""


@dataclass(frozen=True)
class AuditReport:
    """Each rank's device mixes (in the order they happened), for one recipe."""

    recipe: str
    ranks: tuple[tuple[DeviceMix, ...], ...]
    steps: int = 1
    platform: str = PLATFORM

    @property
    def clean(self) -> bool:
        return not any(self.ranks)

    def first(self, rank: int | None = None) -> tuple[int, DeviceMix] | None:
        """The first mix of ``rank`` (default: of the lowest rank that has one)."""
        for r, mixes in enumerate(self.ranks):
            if mixes and (rank is None or r == rank):
                return r, mixes[0]
        return None

    def line(self, rank: int | None = None) -> str:
        """One line: clean, or the first mix (op, devices, file:line) and how many there are."""
        found = self.first(rank)
        scope = f"rank {rank}" if rank is not None else f"{len(self.ranks)} ranks"
        if found is None:
            run = ("on emulated CUDA devices" if self.platform == "gpu_nccl"
                   else "on the CPU of a machine with emulated CUDA devices")
            return (f"device audit {self.recipe} ({self.platform}): clean on {scope} "
                    f"({self.steps} training step {run})")
        r, mix = found
        total = sum(len(m) for m in self.ranks) if rank is None else len(self.ranks[r])
        more = f" (+{total - 1} more)" if total > 1 else ""
        return f"device audit {self.recipe} ({self.platform}): rank {r}: {mix.line()}{more}"


def _applied_cpu_runtime() -> list[Any]:
    """The CPU-runtime patches applied in this process: megatron-core's, megatron/training's
    and, where this process imported Megatron-Bridge, Bridge's."""
    from ..patching import CPU_RUNTIME_PATCHES, TRAINING_CPU_RUNTIME_PATCHES, is_applied

    patches = CPU_RUNTIME_PATCHES + TRAINING_CPU_RUNTIME_PATCHES
    if "megatron.bridge" in sys.modules:
        from ..bridge.cpu_runtime import BRIDGE_CPU_RUNTIME_PATCHES

        patches += BRIDGE_CPU_RUNTIME_PATCHES
    return [p for p in patches if is_applied(p)]


def _refuse_cpu_runtime() -> None:
    applied = [p.name for p in _applied_cpu_runtime()]
    if applied:
        raise AuditError(f"this process has the CPU runtime patches applied ({applied[0]}, ...), "
                         "which put megatron's CUDA tensors on the CPU and hide device mixes; "
                         "audit in processes of its own (audit_recipe starts them)")


@contextlib.contextmanager
def _cpu_runtime_of_this_run() -> Iterator[None]:
    """The CPU runtime patches a ``cpu_gloo`` run applies are reverted after it (the process
    may audit GPU runs next)."""
    from ..patching import revert

    before = {p.name for p in _applied_cpu_runtime()}
    try:
        yield
    finally:
        revert([p for p in _applied_cpu_runtime() if p.name not in before])


def audit_rank(recipe_path: str, steps: int = 1, platform: str = PLATFORM
               ) -> list[dict[str, Any]]:
    """This rank's part of the audit (run on every rank of an initialized world of the recipe's
    size, gloo); returns its findings as JSON-ready dicts.

    ``platform="gpu_nccl"``: the run of a GPU job, on emulated CUDA devices - findings are
    device mixes. ``"cpu_gloo"``: the CPU run on a machine that has CUDA - findings are mixes
    and every use of CUDA."""
    import torch
    import torch.distributed as dist

    from .launch import PLATFORMS
    from .recipe import load_recipe

    if platform not in PLATFORMS:
        raise AuditError(f"platform={platform!r}: use one of {', '.join(PLATFORMS)}")
    recipe = load_recipe(recipe_path)
    if dist.get_world_size() != recipe.nproc:
        raise AuditError(f"recipe {recipe.name} runs on {recipe.nproc} ranks; this world has "
                         f"{dist.get_world_size()}")
    gpu = platform == "gpu_nccl"
    if gpu:
        _refuse_cpu_runtime()
    # first without forward stacks (a third of the cost); where a rank's first finding is in a
    # backward op, every rank reruns the step with them, so that it is located at its forward op
    mixes = _step(recipe, platform, steps, forward_stacks=False)
    again = torch.tensor([bool(mixes) and mixes[0].phase == "backward"], dtype=torch.int32)
    dist.all_reduce(again, op=dist.ReduceOp.MAX)
    if again.item():
        mixes = _step(recipe, platform, steps, forward_stacks=True)
    return [mix.to_json() for mix in mixes]


def _step(recipe: Any, platform: str, steps: int, *, forward_stacks: bool) -> list[DeviceMix]:
    """One audited run of ``steps`` steps on this rank; its findings."""
    import torch
    import torch.distributed as dist

    from ..harness.virtual_cuda import virtual_cuda
    from .bridge_recipe import BridgeRecipe

    gpu = platform == "gpu_nccl"
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    with contextlib.ExitStack() as stack:
        if not gpu:
            stack.enter_context(_cpu_runtime_of_this_run())
        audit = stack.enter_context(virtual_cuda(local, device_count=max(8, local + 1),
                                                 cpu_run=not gpu,
                                                 forward_stacks=forward_stacks))
        if gpu:
            torch.cuda.set_device(local)  # as the gpu_nccl worker does
        if isinstance(recipe, BridgeRecipe):
            from ..bridge.run import prepare_environment
            from .bridge_worker import train_bridge_recipe

            prepare_environment(cpu=not gpu)
            with tempfile.TemporaryDirectory(prefix="megatron-hcp-audit-") as work:
                shared = [work]
                dist.broadcast_object_list(shared, src=0)  # one data directory for the job
                train_bridge_recipe(recipe, platform, shared[0], steps=steps)
                dist.barrier()  # rank 0's directory outlives every reader
        else:
            from .worker import platform_spec, train_recipe

            train_recipe(recipe, platform_spec(recipe, platform, steps=steps), platform)
    return list(audit.mixes)


def audit_recipe(recipe: Any, *, steps: int = 1, platform: str = PLATFORM,
                 world: Any = None) -> AuditReport:
    """Audit ``recipe`` (a loaded recipe) on its ranks (see :func:`audit_rank`): ``world`` is a
    :class:`~megatron_hcp.harness.local_world.LocalWorld` of ``recipe.nproc`` ranks kept for audits,
    or None to start one for this call."""
    from ..harness.local_world import LocalWorld

    if world is None:
        # not daemonic: megatron's checkpoint writer (a finetune's base checkpoint) starts a
        # process of its own
        with LocalWorld(recipe.nproc, timeout_s=600, daemon=False) as own:
            return audit_recipe(recipe, steps=steps, platform=platform, world=own)
    if world.world_size != recipe.nproc:
        raise AuditError(f"recipe {recipe.name} runs on {recipe.nproc} ranks; the world given "
                         f"has {world.world_size}")
    per_rank = world.run(audit_rank, str(recipe.path), steps, platform)
    return AuditReport(recipe.name, tuple(tuple(DeviceMix.from_json(m) for m in mixes)
                                          for mixes in per_rank), steps, platform)
