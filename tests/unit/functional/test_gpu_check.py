"""./scripts/gpu_check.sh and the GPU suite (tests/gpu) on a machine without GPUs: every check
is skipped with the reason it names, none counts as passed, the default run deselects them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_hcp.functional.bridge_recipe import bridge_available
from megatron_hcp.functional.harness import recipe_dir
from megatron_hcp.functional.recipe import load_recipe
from megatron_hcp.harness.local_world import LocalWorld
from tests.gpu._recipes import (
    ONE_RANK_SOURCE,
    one_rank_families,
    one_rank_golden,
    one_rank_recipe,
    shipped_recipes,
)
from tests.gpu.report import main as report_main
from tests.gpu.report import passed_params, read_checks, summary

ROOT = Path(__file__).resolve().parents[3]
NO_GPU = "none here (torch.cuda.is_available() is False)"


def no_gpu_env(**extra: str) -> dict[str, str]:
    """This environment with no GPU visible (whatever the machine has) and this checkout first."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **extra}


def gpu_goldens() -> set[Path]:
    return set(ROOT.glob("tests/functional/test_cases/*/golden_values_dev_gpu_nccl.json"))


@pytest.mark.multirank
def test_gpu_check_without_gpus_skips_every_check_with_its_reason(tmp_path):
    goldens = {path: path.stat().st_mtime_ns for path in gpu_goldens()}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--benchmark", "--record-golden"],
        env=no_gpu_env(PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # what it runs with, installing nothing
    assert f"python: {sys.executable}" in out and f"torch: {torch.__version__}" in out
    assert "megatron-core: " in out and "transformer-engine: " in out and "pytest: " in out
    assert f"megatron-hcp: {ROOT / 'megatron_hcp'}" in out
    assert "no CUDA GPU here" in out
    checks = read_checks(tmp_path / "gpu_check.xml")
    assert len(checks) > 50 and all(c.outcome == "skipped" for c in checks)
    assert all(c.gpus == "-" and c.figure == "" for c in checks)
    reasons = {c.name: c.result for c in checks}
    needs_one = {n: r for n, r in reasons.items() if n.startswith("test_one_gpu")}
    bridge = bridge_available()  # None: installed; else why not (then its families say so)
    assert needs_one and all(
        r.startswith(f"skipped: needs 1 CUDA GPU; {NO_GPU}")
        or (bridge is not None and "[bridge_" in n and r.startswith(
            f"skipped: Megatron-Bridge's loop: {bridge}")) for n, r in needs_one.items()), (
        needs_one)
    for name, nproc in shipped_recipes().items():  # each recipe needs one GPU per rank
        assert reasons[f"test_multi_gpu_recipes::test_recipe_under_gpu_nccl[{name}]"] == (
            f"skipped: needs {nproc} CUDA GPUs; {NO_GPU}")
    nccl = [r for n, r in reasons.items() if n.startswith("test_multi_gpu_attention")]
    assert nccl and all(r.startswith(f"skipped: needs 2 CUDA GPUs; {NO_GPU}") for r in nccl)
    te = [r for n, r in reasons.items() if "te_" in n.split("::")[1]]
    assert te and all("needs Transformer Engine" in r for r in te)
    # the table: every check, skipped with its reason, none passed
    table = (tmp_path / "summary.txt").read_text()
    assert f"0 passed, 0 failed, 0 errors, {len(checks)} skipped" in table
    assert not re.search(r"\| passed", table)
    assert "skipped: needs 1 CUDA GPU; none here" in out.split("--device cuda")[-1]
    assert "recorded golden_values_dev_gpu_nccl.json for 0 recipe(s)" in out
    assert {path: path.stat().st_mtime_ns for path in gpu_goldens()} == goldens  # none written


@pytest.mark.multirank
def test_gpu_check_refuses_an_environment_without_torch(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # no site-packages
    fake.chmod(0o755)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")],
                          env=no_gpu_env(PYTHON=str(fake), GPU_CHECK_OUT=str(tmp_path / "o")),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "does not import" in proc.stderr and "PYTHON=" in proc.stderr


@pytest.mark.multirank
def test_the_default_run_deselects_the_gpu_suite():
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q"],
                          cwd=ROOT, env=no_gpu_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 5, proc.stdout[-2000:]  # 5: nothing collected
    assert re.search(r"no tests collected \(\d+ deselected\)", proc.stdout), proc.stdout[-500:]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_x" name="test_a[one]"><properties>
<property name="gpus" value="1"/><property name="figure" value="max error 1e-12"/>
</properties></testcase>
<testcase classname="tests.gpu.test_x" name="test_a[two]"><failure message="assert 2 == 1
where ...">trace</failure></testcase>
<testcase classname="tests.gpu.test_x" name="test_a[three]"><skipped type="pytest.skip"
message="needs 2 CUDA GPUs; this machine has 1">x</skipped></testcase>
</testsuite></testsuites>"""


def test_summary_never_counts_a_skipped_check_as_passed(tmp_path, capsys):
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    checks = read_checks(xml)
    assert [(c.name, c.gpus, c.result, c.figure) for c in checks] == [
        ("test_x::test_a[one]", "1", "passed", "max error 1e-12"),
        ("test_x::test_a[two]", "-", "failed: assert 2 == 1 where ...", ""),
        ("test_x::test_a[three]", "-", "skipped: needs 2 CUDA GPUs; this machine has 1", ""),
    ]
    text = summary(checks)
    assert [col.strip() for col in text.splitlines()[0].split("|")] == [
        "check", "GPUs used", "result", "figure"]
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in text
    assert passed_params(checks, "test_x::test_a") == ["one"]
    assert report_main([str(xml)]) == 1  # a failure fails the check
    failure = re.search(r'<testcase [^>]*name="test_a\[two\]">.*?</testcase>', JUNIT, re.S)
    skipped_only = tmp_path / "s.xml"
    skipped_only.write_text(JUNIT.replace(failure.group(0), ""))
    assert report_main([str(skipped_only)]) == 0  # passed + skipped: no failure
    assert report_main([str(xml), "--passed", "test_x::test_a"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "one"


def test_an_interrupted_run_is_never_counted_as_passed(tmp_path):
    """A run stopped by SIGINT leaves a nameless test case (pytest's junit XML): the check that
    was running is reported interrupted, not passed, and the report fails."""
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT.replace("</testsuite>", '<testcase time="0.002" /></testsuite>'))
    checks = read_checks(xml)
    assert checks[-1].outcome == "interrupted" and checks[-1].gpus == "-"
    text = summary(checks)
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in text
    assert text.endswith("the run was interrupted before its end")
    assert sum(c.outcome == "passed" for c in checks) == 1
    failure = re.search(r'<testcase [^>]*name="test_a\[two\]">.*?</testcase>', JUNIT, re.S)
    xml.write_text(JUNIT.replace(failure.group(0), "").replace(
        "</testsuite>", '<testcase time="0.002" /></testsuite>'))
    assert report_main([str(xml)]) == 1  # no failure, but the suite did not finish


def test_one_rank_recipe_is_its_source_on_one_rank(tmp_path):
    source = load_recipe(recipe_dir(ONE_RANK_SOURCE))
    one = load_recipe(one_rank_recipe(tmp_path / "r"))
    assert (one.nproc, one.config.context_parallel_size) == (1, 1) and source.nproc == 4
    assert (one.spec.steps, one.spec.hidden_size, one.spec.seed, one.config.num_layers) == (
        source.spec.steps, source.spec.hidden_size, source.spec.seed, source.config.num_layers)
    doc = yaml.safe_load((tmp_path / "r" / "model_config.yaml").read_text())
    assert "--context-parallel-size" not in doc["MODEL_ARGS"]


def test_one_rank_forms_cover_every_recipe_family(tmp_path):
    """Every shipped recipe is in exactly one family; each family's one-rank form loads as one
    rank without TP/PP/CP/dynamic CP and keeps its model, data and loop (packed THD data for a
    dynamic-CP recipe, Bridge's entry for a Bridge recipe)."""
    from megatron_hcp.functional.bridge_recipe import BridgeRecipe

    families = one_rank_families()
    members = [name for names in families.values() for name in names]
    assert sorted(members) == sorted(shipped_recipes())
    assert len(families) >= 6  # static CP, decentralized, PP, dynamic CP, Bridge pretrain / SFT
    for family in families:
        source = load_recipe(recipe_dir(family))
        one = load_recipe(one_rank_recipe(tmp_path / family, family))
        assert one.nproc == 1 and one.config.context_parallel_size == 1
        assert (one.config.tensor_model_parallel_size, one.config.pipeline_model_parallel_size,
                one.config.dynamic_context_parallel) == (1, 1, False)
        assert one.steps == source.steps
        if isinstance(source, BridgeRecipe):
            assert (one.recipe, one.entry) == (source.recipe, source.entry)
        else:
            assert (one.spec.varlen is None) == (source.spec.varlen is None)
            assert one.spec.virtual_pipeline_model_parallel_size is None
            assert (one.spec.hidden_size, one.config.num_layers) == (
                source.spec.hidden_size, source.config.num_layers)
        assert one_rank_golden(family).name == f"{family}@1rank_gpu_nccl.json"


def test_nccl_world_needs_a_gpu_per_rank():
    with pytest.raises(ValueError, match="NCCL needs one per rank"):
        LocalWorld(torch.cuda.device_count() + 1, backend="nccl").start()
    with pytest.raises(ValueError, match="backend='mpi'"):
        LocalWorld(2, backend="mpi")


def test_nccl_ranks_are_spawned_never_forked():
    """A process forked from one that asked CUDA anything cannot initialize CUDA (the H100's
    'Cannot re-initialize CUDA in forked subprocess'): NCCL ranks start with spawn."""
    assert LocalWorld(1, backend="nccl").start_method == "spawn"
    assert LocalWorld(1).start_method == "forkserver"
    with pytest.raises(ValueError, match="must start with 'spawn'"):
        LocalWorld(1, backend="nccl", start_method="forkserver")


@pytest.mark.parametrize(("args", "message"), [
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--", "--no-such-pytest-flag"], "before finishing the suite"),
])
@pytest.mark.multirank
def test_gpu_check_refuses_what_it_cannot_run(tmp_path, args, message):
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), *args],
                          env=no_gpu_env(PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
