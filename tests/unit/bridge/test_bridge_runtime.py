"""The CPU runtime of Megatron-Bridge's loop and the import-only stand-ins (single process).

Each patch is pinned to the upstream behaviour it exists for, on the installed Bridge 0.6.2
(py312 leg); the listing and the stand-ins also on py311.
"""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_hcp.bridge import import_shims
from tests.unit.bridge._bridge import REAL

needs_bridge = pytest.mark.skipif(
    not REAL, reason="needs Megatron-Bridge 0.6.2 (Python 3.12 only; the py312 leg runs it)")


def test_patch_list_shows_every_bridge_patch(capsys):
    from megatron_hcp.bridge.cpu_runtime import BRIDGE_CPU_RUNTIME_PATCHES, BRIDGE_RUNTIME_PATCHES
    from megatron_hcp.bridge.hook import BRIDGE_LOOP_PATCHES, BRIDGE_PATCHES
    from megatron_hcp.cli import main

    assert main(["patch", "list", "-v"]) == 0
    out = capsys.readouterr().out
    names = [p.name for p in BRIDGE_PATCHES + BRIDGE_LOOP_PATCHES + BRIDGE_RUNTIME_PATCHES
             + BRIDGE_CPU_RUNTIME_PATCHES]
    assert len(names) == len(set(names)) >= 15
    section = out[out.index("megatron-bridge"):]
    assert all(name in section for name in names)
    for name in ("cpu-timers", "cpu-dist-checkpointing", "cpu-ddp-wrap"):  # megatron-core's
        assert name in out[:out.index("megatron-bridge")]


@pytest.fixture
def stand_ins():
    """The import-only stand-ins where the packages are missing; removed afterwards."""
    import megatron.core  # noqa: F401  (megatron decides HAVE_TE before the stand-in exists)

    # every module of the packages (an earlier test module's stand-in submodules too)
    had = {n: m for n, m in sys.modules.items() if n.split(".")[0] in import_shims.IMPORT_SHIMS}
    yield import_shims.install()
    import_shims.remove()
    sys.modules.update(had)


def test_import_only_stand_ins_import_and_nothing_else(stand_ins):
    from megatron_hcp.attention.te import installed_te_version, te_unavailable_reason

    assert set(stand_ins) == {"transformer_engine", "nvidia_resiliency_ext"}
    import transformer_engine.pytorch as te  # what Bridge's peft module does
    from nvidia_resiliency_ext.inprocess import CallWrapper  # what Bridge's pretrain does

    assert isinstance(te.Linear, type)
    with pytest.raises(RuntimeError, match="in-process restart cannot run"):
        CallWrapper()
    # the stand-in is no Transformer Engine: megatron-hcp does not take it for one
    assert te_unavailable_reason() == "Transformer Engine is not installed"
    assert installed_te_version() is None
    assert import_shims.install() == stand_ins  # idempotent


@pytest.fixture(scope="module")
def bridge_loop():
    """Bridge's training modules imported (with the stand-ins); the patches prepare_environment
    applies to Bridge's code (its CPU runtime and the runtime patches of every device)
    reverted, so each test starts from Bridge's own code."""
    if not REAL:
        pytest.skip("needs Megatron-Bridge 0.6.2 (Python 3.12 only; the py312 leg runs it)")
    from megatron_hcp.bridge.cpu_runtime import BRIDGE_RUNTIME_PATCHES, revert_bridge_cpu_runtime
    from megatron_hcp.bridge.run import prepare_environment
    from megatron_hcp.patching.registry import revert

    prepare_environment(cpu=True)
    revert_bridge_cpu_runtime()
    revert(BRIDGE_RUNTIME_PATCHES)
    from megatron.bridge.training import initialize

    yield initialize
    revert_bridge_cpu_runtime()
    revert(BRIDGE_RUNTIME_PATCHES)


@needs_bridge
def test_the_wheels_dataset_helpers_need_no_make(bridge_loop):
    """Bridge 0.6.2 always runs megatron-core's compile_helpers (make in the installed package);
    the 0.19.2 wheel ships the helpers compiled and no Makefile, so Bridge exits. Patched, the
    prebuilt helpers are used."""
    from megatron_hcp.bridge.cpu_runtime import BRIDGE_RUNTIME_PATCHES
    from megatron_hcp.patching.registry import apply, revert

    helpers = [p for p in BRIDGE_RUNTIME_PATCHES
               if p.name == "bridge-prebuilt-dataset-helpers"]
    with pytest.raises(SystemExit):
        bridge_loop.compile_helpers()
    apply(helpers)
    try:
        assert bridge_loop.compile_helpers() is None
    finally:
        revert(helpers)


@needs_bridge
@pytest.mark.multirank  # inductor starts its compile workers
def test_the_jit_warm_up_leaves_the_cpu_generator_alone(bridge_loop):
    """Bridge's JIT warm-up draws random 'cuda' tensors of seq_length // CP rows (and dropout):
    under the CPU view they would advance the CPU generator that initializes the model, so the
    weights would depend on the CP size. The patched warm-up restores the generator."""
    from types import SimpleNamespace

    from megatron_hcp.bridge.cpu_runtime import apply_bridge_cpu_runtime, revert_bridge_cpu_runtime

    config = SimpleNamespace(  # the fields Bridge's warm-up reads of a GPT provider
        bf16=False, fp16=False, hidden_size=16, ffn_hidden_size=32, seq_length=64,
        tensor_model_parallel_size=1, context_parallel_size=2, sequence_parallel=False,
        activation_func=torch.nn.functional.gelu)
    apply_bridge_cpu_runtime()
    try:
        warmup = bridge_loop._warmup_jit_function
        state = torch.get_rng_state()
        warmup(config, 1)
        assert torch.equal(torch.get_rng_state(), state)
        warmup.__megatron_hcp_original__(config, 1)  # Bridge's own, under the same CPU view
        assert not torch.equal(torch.get_rng_state(), state)
    finally:
        revert_bridge_cpu_runtime()


@needs_bridge
def test_bridge_patches_refuse_a_release_they_were_not_written_for(bridge_loop):
    from megatron_hcp.bridge.cpu_runtime import BRIDGE_CPU_RUNTIME_PATCHES, BRIDGE_RUNTIME_PATCHES
    from megatron_hcp.bridge.hook import BRIDGE_LOOP_PATCHES, install, uninstall
    from megatron_hcp.patching.registry import PatchError, apply, is_applied

    uninstall()  # the loop patches are the hook's
    try:
        for patches in (BRIDGE_RUNTIME_PATCHES, BRIDGE_CPU_RUNTIME_PATCHES, BRIDGE_LOOP_PATCHES):
            with pytest.raises(PatchError, match="not 0.6.1"):
                apply(patches, version="0.6.1")
            assert not any(is_applied(p) for p in patches)  # nothing was changed
    finally:
        install()


@needs_bridge
def test_cpu_runtime_reverts_to_bridges_own_functions(bridge_loop):
    from megatron_hcp.bridge.cpu_runtime import apply_bridge_cpu_runtime, revert_bridge_cpu_runtime

    before = (bridge_loop.initialize_megatron, bridge_loop.torch, bridge_loop.HyperCommGrid)
    applied = apply_bridge_cpu_runtime()
    assert "bridge-cpu-initialize" in applied and bridge_loop.torch is not before[1]
    from megatron.bridge.training import setup

    assert setup.initialize_megatron is bridge_loop.initialize_megatron  # by-value import too
    revert_bridge_cpu_runtime()
    assert (bridge_loop.initialize_megatron, bridge_loop.torch,
            bridge_loop.HyperCommGrid) == before
    assert setup.initialize_megatron is before[0]
