"""One GPU: a megatron GPT trains through the project's trainer on the GPU (local spec with the
reference CP attention; TE spec where Transformer Engine imports); ``functional run`` under
``--platform gpu_nccl`` of the one-rank form of every recipe family (static CP, dynamic CP's
packed THD data, the decentralized path, PP/VPP recipes' models, Megatron-Bridge's own loop);
several CP ranks as threads on the one GPU; each against the same run on the CPU."""

from __future__ import annotations

import contextlib

import pytest

from megatron_hcp.functional.golden import compare, load_golden
from megatron_hcp.functional.harness import run_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe
from megatron_hcp.harness.local_world import LocalWorld
from tests.gpu._need import needs
from tests.gpu._recipes import one_rank_families, one_rank_golden, one_rank_recipe

pytestmark = [pytest.mark.gpu, needs(1)]
STEPS = 4
RTOL = {"reference": 1e-4, "te": 1e-3}  # fp32 model; TE's fused layers round differently


def train_one_rank(device: str, backend: str) -> dict:
    """One rank (gloo on CPU, NCCL on its GPU): megatron's MPU groups, the tiny GPT of the CPU
    tests, ``STEPS`` steps through ``train_tiny_gpt``."""
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
    from megatron_hcp.patching import apply, apply_cpu_runtime, by_name
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    if device == "cpu":
        apply_cpu_runtime()
    if backend == "te":
        apply(by_name(["te-attention-hcp"]))
    initialize_model_parallel(CPConfig(num_attention_heads=4, num_query_groups=2,
                                       seq_length=64), create_gloo_process_groups=False)
    try:
        return train_tiny_gpt(TinyGPTSpec.of(
            num_layers=2, num_attention_heads=4, num_query_groups=2, steps=STEPS,
            device=device, attention_backend=backend))
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def cpu_history():
    with LocalWorld(1) as world:
        return world.run(train_one_rank, "cpu", "reference")[0]


def max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend", [
    "reference", pytest.param("te", marks=needs(1, te=True))], ids=["local_spec", "te_spec"])
def test_gpt_trains_on_the_gpu_like_on_the_cpu(cpu_history, report, backend):
    with LocalWorld(1, backend="nccl") as world:
        gpu = world.run(train_one_rank, "cuda", backend)[0]
    dev = max_rel(gpu["loss"], cpu_history["loss"])
    report(1, f"{STEPS} steps (lm loss {gpu['loss'][0]:.4f} .. {gpu['loss'][-1]:.4f}); "
              f"max rel deviation from the CPU run {dev:.1e} (tol {RTOL[backend]:.0e})")
    assert len(gpu["loss"]) == STEPS and dev <= RTOL[backend]


def _bridge_missing(name: str) -> str | None:
    from megatron_hcp.functional.bridge_recipe import bridge_available

    return bridge_available() if name.startswith("bridge_") else None


@pytest.mark.parametrize("family", [
    pytest.param(name, marks=pytest.mark.skipif(
        _bridge_missing(name) is not None,
        reason=f"Megatron-Bridge's loop: {_bridge_missing(name)}"))
    for name in sorted(one_rank_families())])
def test_one_rank_form_on_one_gpu(tmp_path, report, family):
    """``functional run --platform gpu_nccl`` (torchrun, NCCL, the worker's GPU path; Bridge's
    own loop for a Bridge recipe) of the one-rank form of a recipe family, against the same run
    under cpu_gloo on this machine, and against its gpu_nccl golden values where recorded
    (``./scripts/gpu_check.sh --record-golden``)."""
    recipe = load_recipe(one_rank_recipe(tmp_path / family, family))
    gpu = run_recipe(recipe, echo=None, launch=Launch(platform="gpu_nccl"))
    cpu = run_recipe(recipe, echo=None, launch=Launch(platform="cpu_gloo"))["lm loss"]
    steps = sorted(cpu)
    dev = max_rel([gpu["lm loss"][s] for s in steps], [cpu[s] for s in steps])
    # the worker picks TE's attention where TE imports (backend "auto"): TE's tolerance then
    tol = max(RTOL.values())
    golden_path = one_rank_golden(family)
    if golden_path.is_file():
        golden = compare(gpu, load_golden(golden_path))
        against = f"; vs its gpu_nccl golden values {golden.max_loss_rel:.1e}"
    else:
        golden, against = None, "; no gpu_nccl golden values yet (--record-golden writes them)"
    report(1, f"{family} on 1 rank ({', '.join(one_rank_families()[family])}), {len(steps)} "
              f"steps; max rel deviation of lm loss from cpu_gloo {dev:.1e} (tol {tol:.0e})"
              + against)
    assert sorted(gpu["lm loss"]) == steps and dev <= tol
    assert golden is None or golden.passed, "\n".join(golden.lines)


# ---------------------------------------------------------------- CP ranks as threads
CP_THREADS = 4
THREAD_LAYOUTS = {"cp4_p2p": (4, "p2p", None), "cp4_a2a": (4, "a2a", None),
                  "hcp_2x2": (4, "a2a+p2p", [2, 2])}


def train_cp_threads(device: str, cp: int, comm: str | None, hcp: list[int] | None) -> dict:
    """One rank thread of a ThreadedWorld of CP_THREADS: the recipes' tiny GPT (megatron's
    GPTModel with RoPE and GQA, the reference CP attention, megatron's loss, DDP, optimizer)
    through a decentralized process-group collection - no MPU globals, which the threads would
    share - with CP=``cp`` and the other ranks data-parallel, STEPS steps."""
    from megatron_hcp.config import CPConfig
    from megatron_hcp.parallel_state.collection import create_pg_collection, destroy_pg_collection
    from megatron_hcp.training.trainer import TinyGPTSpec, train_tiny_gpt

    config = CPConfig(context_parallel_size=cp, cp_comm_type=comm,
                      hierarchical_context_parallel_sizes=hcp,
                      data_parallel_size=CP_THREADS // cp, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, seq_length=64)
    pgc = create_pg_collection(config)
    try:
        return train_tiny_gpt(TinyGPTSpec(config=config, steps=STEPS, device=device,
                                          global_batch_size=8, micro_batch_size=1),
                              pg_collection=pgc)
    finally:
        destroy_pg_collection(pgc)


@contextlib.contextmanager
def threads_of_one_process(device: str):
    """A ThreadedWorld of CP_THREADS ranks on ``device``, with what megatron needs of one
    process per rank made safe for threads: its model-parallel RNG tracker (one per process)
    is seeded under a lock; on the CPU, the CPU runtime (reverted after)."""
    import threading

    import megatron.core.tensor_parallel.random as mp_random

    from megatron_hcp.harness.threaded_world import ThreadedWorld
    from megatron_hcp.patching import (
        DECENTRALIZED_PATCHES,
        apply,
        apply_cpu_runtime,
        by_name,
        revert,
    )

    seed, lock = mp_random.model_parallel_cuda_manual_seed, threading.Lock()

    def seeded(*args, **kwargs):
        with lock:
            return seed(*args, **kwargs)

    applied = apply(by_name(list(DECENTRALIZED_PATCHES)))
    applied += apply_cpu_runtime() if device == "cpu" else []
    mp_random.model_parallel_cuda_manual_seed = seeded
    try:
        with ThreadedWorld(CP_THREADS, device=device) as world:
            yield world
    finally:
        mp_random.model_parallel_cuda_manual_seed = seed
        revert(by_name(applied))  # what this block applied, no more


def cp_threads_against_cp1(device: str) -> dict[str, float]:
    """Largest relative deviation of lm loss per step from the CP=1 run (DP over the same
    threads), for every layout of THREAD_LAYOUTS."""
    with threads_of_one_process(device) as world:
        base = world.run(train_cp_threads, device, 1, None, None)[0]["loss"]
        out = {}
        for name, (cp, comm, hcp) in THREAD_LAYOUTS.items():
            runs = world.run(train_cp_threads, device, cp, comm, hcp)
            assert all(r["loss"] == runs[0]["loss"] for r in runs), "ranks disagree"
            out[name] = max_rel(runs[0]["loss"], base)
    return out


def test_cp_ranks_as_threads_on_one_gpu(report):
    """Several CP ranks on the one GPU, as threads of one process (NCCL refuses two ranks on one
    device): megatron's model with RoPE, the reference CP attention and the loss, forward and
    backward and optimizer steps, CP=4 (p2p, a2a, hierarchical 2x2) against CP=1 on CUDA."""
    deviation = cp_threads_against_cp1("cuda")
    report(1, f"{CP_THREADS} rank threads, {STEPS} steps; lm loss vs CP=1: " + ", ".join(
        f"{name} {dev:.1e}" for name, dev in deviation.items()) + f" (tol {RTOL['reference']:.0e})")
    assert all(dev <= RTOL["reference"] for dev in deviation.values()), deviation
