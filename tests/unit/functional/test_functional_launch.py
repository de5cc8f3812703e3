"""`functional run/compare/update-golden` launch settings: torchrun node flags, platform, golden
file per platform (pure; no ranks are started)."""

from __future__ import annotations

import shutil

import pytest

from megatron_hcp.cli import main, parse_and_check
from megatron_hcp.functional import harness
from megatron_hcp.functional.golden import load_golden
from megatron_hcp.functional.launch import (
    Launch,
    LaunchError,
    default_platform,
    detect_platform,
    require_runnable,
)
from megatron_hcp.functional.recipe import RECIPES_DIR, load_recipe

RECIPE = "gpt3_mcore_tp1_pp1_cp4_p2p"


def test_default_launch_is_one_node_on_loopback_with_a_free_port():
    assert Launch().torchrun_args(4) == ["--nnodes=1", "--nproc-per-node=4",
                                         "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    assert Launch().backend == "gloo" and Launch().checks_results


def test_multi_node_launch_passes_torchruns_node_flags():
    launch = Launch(nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29500)
    assert launch.torchrun_args(8) == ["--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
                                       "--master-addr=10.0.0.5", "--master-port=29500"]
    assert not launch.checks_results
    assert Launch(master_port=29400).torchrun_args(2)[-1] == "--master-port=29400"


@pytest.mark.parametrize("launch, words", [
    (Launch(nnodes=3, master_addr="10.0.0.5", master_port=1), ["--nnodes 3", "divide", "8"]),
    (Launch(nnodes=2, node_rank=2, master_addr="h", master_port=1), ["--node-rank 2", "0..1"]),
    (Launch(nnodes=2, master_addr="h"), ["--master-port", "required"]),
    (Launch(nnodes=2, master_port=29500), ["--master-addr 127.0.0.1", "loopback"]),
    (Launch(master_port=70000), ["--master-port 70000", "1..65535"]),
    (Launch(platform="tpu"), ["--platform tpu", "cpu_gloo"]),
    (Launch(launcher="mpirun"), ["--launcher mpirun", "torchrun, forkserver"]),
    (Launch(launcher="forkserver", platform="gpu_nccl"), ["--platform gpu_nccl", "one CPU node"]),
    (Launch(launcher="forkserver", nnodes=2, master_addr="h", master_port=1),
     ["--nnodes 2", "--launcher torchrun"]),
    (Launch(launcher="forkserver", master_port=29500), ["--master-port 29500", "own"]),
])
def test_bad_launch_settings_are_one_clear_line(launch, words):
    with pytest.raises(LaunchError) as err:
        launch.torchrun_args(8)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_platform_detection():
    import torch

    gpu = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert detect_platform() == default_platform() == ("gpu_nccl" if gpu else "cpu_gloo")
    require_runnable("cpu_gloo")
    if not gpu:
        with pytest.raises(LaunchError, match="--platform gpu_nccl: .*no CUDA.*cpu_gloo"):
            require_runnable("gpu_nccl")


@pytest.mark.parametrize("extra, words", [
    (["--nnodes", "3", "--master-addr", "h", "--master-port", "1"], ["--nnodes 3", "divide"]),
    (["--platform", "gpu_nccl"], ["--platform gpu_nccl", "cpu_gloo"]),
    (["--nnodes", "2", "--master-addr", "h"], ["--master-port", "required"]),
    (["--launcher", "forkserver", "--master-port", "29500"], ["--launcher forkserver", "own"]),
])
@pytest.mark.parametrize("command", ["run", "update-golden"])
def test_cli_refuses_bad_launch_before_any_rank(command, extra, words, capsys):
    assert main(["functional", command, RECIPE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_cli_builds_the_launch():
    args = parse_and_check(["functional", "run", RECIPE, "--nnodes", "2", "--node-rank", "1",
                            "--master-addr", "10.1.2.3", "--master-port", "29501",
                            "--platform", "cpu_gloo"])
    assert args.launch == Launch(2, 1, "10.1.2.3", 29501, "cpu_gloo")
    assert parse_and_check(["functional", "run", RECIPE, "--launcher", "forkserver"]
                           ).launch.launcher == "forkserver"
    assert parse_and_check(["functional", "compare", RECIPE]).launch.master_addr == "127.0.0.1"


def _metrics(steps: int) -> dict:
    return {name: {s: 4.0 + s / 100 for s in range(1, steps + 1)}
            for name in ("lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")}


def test_update_golden_writes_the_platforms_own_file(tmp_path, monkeypatch):
    # the ranks are replaced by a finished run's metrics; the file choice is what is tested
    shutil.copy(RECIPES_DIR / RECIPE / "model_config.yaml", tmp_path / "model_config.yaml")
    recipe = load_recipe(tmp_path)
    seen = []

    def finished_run(recipe, *, launch=None, **kw):
        seen.append(launch)
        return _metrics(recipe.spec.steps) if launch.checks_results else {}

    monkeypatch.setattr(harness, "run_recipe", finished_run)
    harness.update_golden(recipe, echo=None, launch=Launch(platform="gpu_nccl"))
    written = tmp_path / "golden_values_dev_gpu_nccl.json"
    assert sorted(p.name for p in tmp_path.glob("golden_values_*")) == [written.name]
    assert load_golden(written)["lm loss"]["end_step"] == recipe.spec.steps
    other = Launch(nnodes=2, node_rank=1, master_addr="h", master_port=1, platform="cpu_gloo")
    lines = harness.update_golden(recipe, echo=None, launch=other)
    assert "node 0 writes" in lines[0] and not (tmp_path / "golden_values_dev_cpu_gloo.json"
                                                ).exists()
    assert seen[-1] is other


def test_compare_checks_the_node_count_against_every_recipe(capsys):
    # 8 nodes divide the 8-rank recipes but not the 4-rank ones: refused before any rank
    argv = ["functional", "compare", "--nnodes", "8", "--master-addr", "h", "--master-port", "1"]
    assert main(argv) == 2
    assert "--nnodes 8: must divide the recipe's 4 ranks" in capsys.readouterr().err
