"""The device audit in CI (no GPU): every shipped recipe's ``gpu_nccl`` training step on emulated
CUDA devices, every rank (so every rank role: first / last pipeline stage, TP and CP ranks, idle
dynamic-CP positions), must be free of device mixes; the CPU run on a machine with CUDA must not
use CUDA; and the audit names the defects found on the first H100 (2026-11-26, at 947f668) when
they are put back.

The ranks are processes of pooled worlds, one per recipe size, kept for audits only (the
emulation changes a process for good, and CPU-runtime patches would hide mixes)."""

from __future__ import annotations

import pytest

from megatron_hcp.functional.audit import AuditReport, audit_rank, audit_recipe
from megatron_hcp.functional.bridge_recipe import BridgeRecipe, bridge_available
from megatron_hcp.functional.harness import recipe_dir
from megatron_hcp.functional.recipe import list_recipes, load_recipe
from megatron_hcp.harness.local_world import LocalWorld
from megatron_hcp.harness.virtual_cuda import DeviceMix

RECIPES = {name: load_recipe(recipe_dir(name)) for name in list_recipes()}
BRIDGE_MISSING = bridge_available()
# the CPU run on a machine with CUDA: one recipe per path through the code (MPU path with
# static CP; decentralized collection with HCP; dynamic CP with PP and VPP; Bridge's loop)
CPU_RUNS = ("gpt3_mcore_tp1_pp1_cp4_p2p", "gpt3_mcore_tp2_pp1_cp4_a2a_p2p_decentralized_pg",
            "gpt3_mcore_tp1_pp2_vpp2_cp2_dcp", "bridge_llama_tp2_pp1_cp2_dcp")


@pytest.fixture(scope="module")
def worlds():
    """One audit world per recipe size, started on first use (non-daemonic ranks: Bridge's
    checkpoint writer starts a process)."""
    started: dict[int, LocalWorld] = {}

    def world(size: int) -> LocalWorld:
        if size not in started:
            started[size] = LocalWorld(size, timeout_s=600, daemon=False).start()
        return started[size]

    yield world
    for w in started.values():
        w.close()


def _param(name: str):
    recipe = RECIPES[name]
    bridge = isinstance(recipe, BridgeRecipe)
    return pytest.param(name, marks=pytest.mark.skipif(
        bridge and BRIDGE_MISSING is not None,
        reason=f"Megatron-Bridge's loop: {BRIDGE_MISSING} (the py312 leg audits it)"))


def _detail(report: AuditReport) -> str:
    return "\n".join(f"rank {r}: {m.line()}" for r, mixes in enumerate(report.ranks)
                     for m in mixes)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [_param(n) for n in sorted(RECIPES)])
def test_the_gpu_run_of_every_recipe_has_no_device_mix(worlds, name):
    recipe = RECIPES[name]
    report = audit_recipe(recipe, world=worlds(recipe.nproc))
    assert len(report.ranks) == recipe.nproc
    assert report.clean, _detail(report)


# Bridge's families without a functional recipe of their own (Qwen3-MoE, DeepSeek-V3 and gpt-oss
# have one, audited above): their Bridge recipe's GPU run, one step at CP4 a2a+p2p [2,2]
UNRECIPED_FAMILIES = ("llama3", "qwen3", "gemma3", "nemotron_h")


def _family_recipe(family: str, root) -> BridgeRecipe:
    """A Bridge recipe directory of ``family`` (megatron_hcp.bridge.family_recipes), written
    under ``root`` as the shipped ones are, and loaded."""
    import yaml

    path = root / f"bridge_{family}_tp1_pp1_cp4_a2a_p2p"
    path.mkdir()
    (path / "model_config.yaml").write_text(yaml.safe_dump({
        "ENV_VARS": {}, "NPROC": 4, "TEST_TYPE": "regular",
        "BRIDGE": {"recipe": "tiny_family_pretrain_config", "recipe_args": {"family": family},
                   "entry": "pretrain",
                   "overrides": ["model.context_parallel_size=4", "model.cp_comm_type=a2a+p2p",
                                 "model.hierarchical_context_parallel_sizes=[2,2]",
                                 "train.train_iters=1"]}}))
    recipe = load_recipe(path)
    assert isinstance(recipe, BridgeRecipe) and recipe.nproc == 4
    return recipe


@pytest.mark.multirank
@pytest.mark.skipif(BRIDGE_MISSING is not None,
                    reason=f"Megatron-Bridge's loop: {BRIDGE_MISSING} (the py312 leg audits it)")
@pytest.mark.parametrize("family", UNRECIPED_FAMILIES)
def test_the_gpu_run_of_every_bridge_family_has_no_device_mix(worlds, family, tmp_path):
    report = audit_recipe(_family_recipe(family, tmp_path), world=worlds(4))
    assert len(report.ranks) == 4
    assert report.clean, _detail(report)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [_param(n) for n in CPU_RUNS])
def test_a_cpu_run_on_a_machine_with_cuda_never_uses_cuda(worlds, name):
    recipe = RECIPES[name]
    report = audit_recipe(recipe, platform="cpu_gloo", world=worlds(recipe.nproc))
    assert report.clean, _detail(report)


# ------------------------------------------------------------------ planted defects (per rank)
def _rotary_output_on_the_cpu(original):
    def forward(self, *args, **kwargs):
        return original(self, *args, **kwargs).cpu()

    return forward


def audit_with_rope_on_the_cpu(path: str) -> list[dict]:
    """The audit of ``path`` with megatron's rotary embedding returning its table on the CPU
    (the class of the H100's RoPE failure: cos/sin on the CPU, activations on the GPU)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    original = RotaryEmbedding.forward
    RotaryEmbedding.forward = _rotary_output_on_the_cpu(original)
    try:
        return audit_rank(path)
    finally:
        RotaryEmbedding.forward = original


def audit_with_the_old_cpu_runtime_rule(path: str) -> list[dict]:
    """The CPU run's audit with ``apply_cpu_runtime`` as it was before the H100 run of 2026-11-26:
    nothing applied where CUDA is available (the H100's 'Cannot re-initialize CUDA in forked
    subprocess' from model_parallel_cuda_manual_seed, then RoPE on cuda:0 against the CPU)."""
    import torch

    import megatron_hcp.patching as patching

    fixed = patching.apply_cpu_runtime

    def old(*args, **kwargs):
        return [] if torch.cuda.is_available() else fixed(*args, **kwargs)

    patching.apply_cpu_runtime = old
    try:
        return audit_rank(path, platform="cpu_gloo")
    finally:
        patching.apply_cpu_runtime = fixed


def audit_cp_attention_steps() -> tuple[list[dict], list[str]]:
    """One rank: a forward + backward of every CP attention case of the launch proxy (every
    comm type, thd, a sliding window, GQA, MLA, bf16) on emulated CUDA tensors, with the mixes
    found, and the devices of a packed, windowed block's indices and mask (built once per
    packing on the attention's device)."""
    import torch.distributed as dist

    from megatron_hcp.attention.reference.blocks import plan_block
    from megatron_hcp.attention.reference.launch_proxy import CASES, rank_launches
    from megatron_hcp.attention.reference.seq_layout import SeqLayout
    from megatron_hcp.harness.virtual_cuda import virtual_cuda
    from megatron_hcp.parallel_state.groups import bare_cp_groups

    rank = dist.get_rank()
    with virtual_cuda(rank) as audit:
        rank_launches(CASES, device="cuda", cp_groups=bare_cp_groups)
        layout = SeqLayout((16, 32), (12, 32), 4, rank % 4, device=f"cuda:{rank}")
        block = plan_block(layout, layout.at(4, 0), True, (6, 0))
        devices = [] if block is None else [str(t.device) for t in (block.rows, block.cols,
                                                                     block.mask)]
    return [m.to_json() for m in audit.mixes], devices


def audit_varlen_calls() -> tuple[list[dict], dict]:
    """One rank: packed blocks in pieces, a packed window and a dense window at CP 4, with
    their blocks as FlashAttention-2 varlen calls (``MEGATRON_HCP_VARLEN=auto``: the
    once-per-process kernel check included), on emulated CUDA tensors: the mixes found and
    the kernels the blocks took. The emulation runs CPU kernels, which have no varlen one:
    the per-segment reference (``varlen.reference_*``) stands in for FA2's kernel, and the
    blocks are let take it in fp32; everything around the kernel (offsets, segments, merges,
    gradients, the check) is the code under audit."""
    import torch.distributed as dist

    from megatron_hcp.attention.reference.block_counter import BlockCounter
    from megatron_hcp.attention.reference.gpu import varlen
    from megatron_hcp.attention.reference.launch_proxy import LaunchCase, rank_launches
    from megatron_hcp.harness.virtual_cuda import virtual_cuda
    from megatron_hcp.parallel_state.groups import bare_cp_groups

    cases = (LaunchCase("thd pieces", "p2p", 4, fmt="thd", split="on"),
             LaunchCase("thd window", "p2p", 4, fmt="thd", window=(40, 0), split="on"),
             LaunchCase("window", "a2a+p2p", 4, window=(64, 0), split="on"))
    saved = {name: getattr(varlen, name)
             for name in ("_fa2_takes", "_flash_forward", "_flash_backward")}
    varlen._fa2_takes = lambda q, k, v: q.device.type == "cuda"
    varlen._flash_forward, varlen._flash_backward = (varlen.reference_forward,
                                                     varlen.reference_backward)
    varlen.forget_kernel_checks()
    try:
        with virtual_cuda(dist.get_rank()) as audit, BlockCounter() as counter, \
                varlen.varlening("auto"):
            rank_launches(cases, device="cuda", cp_groups=bare_cp_groups)
    finally:
        for name, value in saved.items():
            setattr(varlen, name, value)
        varlen.forget_kernel_checks()
    return [m.to_json() for m in audit.mixes], dict(counter.kernels)


@pytest.mark.multirank
def test_varlen_calls_on_emulated_cuda_mix_no_devices(worlds):
    """The varlen calls' own device paths (their offsets built once per packing on the
    attention's device, segments, per-batch results, the kernel check's tensors) mix no
    devices, and every rank took them."""
    from megatron_hcp.attention.reference.gpu.varlen import VARLEN_KERNEL

    for rank, (mixes, kernels) in enumerate(worlds(4).run(audit_varlen_calls)):
        assert not mixes, _mixes([mixes])[0][0].line()
        assert kernels.get((VARLEN_KERNEL, ""), 0) > 0, (rank, kernels)


@pytest.mark.multirank
def test_cp_attention_on_emulated_cuda_mixes_no_devices(worlds):
    """The CP attention backend's own device paths, beyond what the recipes reach (windows,
    every comm type, bf16): no op mixes devices, and the per-packing block metadata lives on
    the GPU."""
    per_rank = worlds(4).run(audit_cp_attention_steps)
    for rank, (mixes, devices) in enumerate(per_rank):
        assert not mixes, _mixes([mixes])[0][0].line()
        assert devices in ([], [f"cuda:{rank}"] * 3), devices
    assert any(devices for _, devices in per_rank)


def _mixes(per_rank: list[list[dict]]) -> list[list[DeviceMix]]:
    return [[DeviceMix.from_json(m) for m in mixes] for mixes in per_rank]


@pytest.mark.multirank
def test_the_audit_names_rope_tables_left_on_the_cpu(worlds):
    recipe = RECIPES["gpt3_mcore_tp1_pp1_cp4_p2p"]
    per_rank = _mixes(worlds(recipe.nproc).run(audit_with_rope_on_the_cpu, str(recipe.path)))
    for mixes in per_rank:
        assert mixes, "the audit passed a planted device mix"
        first = mixes[0]
        assert first.kind == "mix" and first.phase == "forward"
        assert set(first.devices) == {"cpu", f"cuda:{per_rank.index(mixes)}"}
        assert first.location.startswith("megatron/core/models/common/embeddings/rope_utils.py:")
        assert "_apply_rotary_pos_emb_bshd" in first.location


@pytest.mark.multirank
def test_the_audit_finds_the_h100_cpu_run_failure(worlds):
    recipe = RECIPES["gpt3_mcore_tp1_pp1_cp4_p2p"]
    per_rank = _mixes(worlds(recipe.nproc).run(audit_with_the_old_cpu_runtime_rule,
                                               str(recipe.path)))
    for mixes in per_rank:
        lines = [m.line() for m in mixes]
        assert any("torch.cuda.get_rng_state()" in line and "random.py" in line
                   for line in lines), lines  # model_parallel_cuda_manual_seed's RNG tracker
        assert any(m.kind == "mix" and "rope_utils.py" in m.location for m in mixes), lines


@pytest.mark.multirank
def test_the_audit_refuses_a_process_with_the_cpu_runtime(worlds):
    recipe = RECIPES["gpt3_mcore_tp1_pp1_cp4_p2p"]
    from megatron_hcp.harness.local_world import RankError

    with pytest.raises(RankError, match="CPU runtime patches applied"):
        worlds(recipe.nproc).run(audit_after_the_cpu_runtime, str(recipe.path))


def audit_after_the_cpu_runtime(path: str) -> list[dict]:
    from megatron_hcp.patching import apply_cpu_runtime, revert_cpu_runtime

    apply_cpu_runtime()
    try:
        return audit_rank(path)
    finally:
        revert_cpu_runtime()


def test_report_lines():
    mix = DeviceMix("aten.mul.Tensor", ("cuda:1", "cpu"), "megatron/x.py:3 in f")
    touch = DeviceMix("torch.cuda.current_device()", ("cpu", "cuda"), "y.py:9 in g", "forward",
                      "cuda-in-cpu-run")
    report = AuditReport("r", ((), (mix, mix), (touch,)), platform="gpu_nccl")
    assert report.line() == ("device audit r (gpu_nccl): rank 1: device mix: aten.mul.Tensor "
                             "on cuda:1 and cpu at megatron/x.py:3 in f (+2 more)")
    assert report.line(2).endswith("rank 2: CUDA used by a CPU run: torch.cuda.current_device() "
                                   "at y.py:9 in g")
    assert report.line(0) == ("device audit r (gpu_nccl): clean on rank 0 (1 training step on "
                              "emulated CUDA devices)")
    assert report.first() == (1, mix) and not report.clean
    assert DeviceMix.from_json(touch.to_json()) == touch


# ------------------------------------------------------------------ the command line
@pytest.mark.multirank
def test_cli_audits_a_recipe_in_ranks_of_its_own(capsys):
    from megatron_hcp.cli import main

    assert main(["functional", "audit", "gpt3_mcore_tp1_pp1_cp4_p2p"]) == 0
    assert capsys.readouterr().out.strip() == (
        "device audit gpt3_mcore_tp1_pp1_cp4_p2p (gpu_nccl): clean on 4 ranks (1 training step "
        "on emulated CUDA devices)")


def test_cli_prints_the_first_finding_and_exits_1(monkeypatch, capsys):
    import megatron_hcp.functional.audit as audit

    mix = DeviceMix("aten.mul.Tensor", ("cuda:2", "cpu"), "megatron/x.py:3 in f")
    monkeypatch.setattr(audit, "audit_recipe", lambda recipe, platform: AuditReport(
        recipe.name, ((), (), (mix,), ()), platform=platform))
    from megatron_hcp.cli import main

    assert main(["functional", "audit", "gpt3_mcore_tp1_pp1_cp4_p2p", "--rank", "2"]) == 1
    assert capsys.readouterr().out.strip() == (
        "device audit gpt3_mcore_tp1_pp1_cp4_p2p (gpu_nccl): rank 2: device mix: aten.mul.Tensor "
        "on cuda:2 and cpu at megatron/x.py:3 in f")
    assert main(["functional", "audit", "gpt3_mcore_tp1_pp1_cp4_p2p", "--rank", "1"]) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["no_such_recipe"], "no recipe 'no_such_recipe'"),
    (["gpt3_mcore_tp1_pp1_cp4_p2p", "--rank", "4"], "--rank 4: recipe "
     "'gpt3_mcore_tp1_pp1_cp4_p2p' runs on 4 ranks; give a rank in 0..3"),
    (["gpt3_mcore_tp1_pp1_cp4_p2p", "--platform", "tpu"], "invalid choice: 'tpu'"),
])
def test_cli_refuses_bad_input_before_any_rank_starts(capsys, args, message):
    from megatron_hcp.cli import main

    assert main(["functional", "audit", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
