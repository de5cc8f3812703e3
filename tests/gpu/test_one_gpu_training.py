"""One GPU: a megatron GPT trains through the project's trainer on the GPU (local spec with the
reference CP attention; TE spec where Transformer Engine imports), and ``functional run`` of a
recipe under ``--platform gpu_nccl`` with the one rank it can have; each against the same run
on the CPU."""

from __future__ import annotations

import pytest

from megatron_hcp.functional.harness import run_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe
from megatron_hcp.local_world import LocalWorld
from tests.gpu._need import needs
from tests.gpu._recipes import ONE_RANK_SOURCE, one_rank_recipe

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


def test_functional_run_on_one_gpu(tmp_path, report):
    """``functional run`` under gpu_nccl (torchrun, NCCL, the worker's GPU path) of the
    one-rank form of a shipped recipe, against the same recipe under cpu_gloo."""
    recipe = load_recipe(one_rank_recipe(tmp_path / "recipe"))
    gpu = run_recipe(recipe, echo=None, launch=Launch(platform="gpu_nccl"))["lm loss"]
    cpu = run_recipe(recipe, echo=None, launch=Launch(platform="cpu_gloo"))["lm loss"]
    steps = sorted(cpu)
    dev = max_rel([gpu[s] for s in steps], [cpu[s] for s in steps])
    # the worker picks TE's attention where TE imports (backend "auto"): TE's tolerance then
    tol = max(RTOL.values())
    report(1, f"{ONE_RANK_SOURCE} on 1 rank, {len(steps)} steps; max rel deviation of lm loss "
              f"from cpu_gloo {dev:.1e} (tol {tol:.0e})")
    assert sorted(gpu) == steps and dev <= tol
