"""The built wheel works on its own: recipes and fork-style diffs ship as package data.

The wheel is built from this checkout and installed (non-editable, ``--no-deps``) into a
throwaway virtualenv that sees the test environment's torch and megatron-core through a path
entry (no second 2.6 GB torch). Every command then runs from an empty directory, so nothing can
come from the source tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(bin directory, empty working directory) of a venv with only the built wheel."""
    base = tmp_path_factory.mktemp("wheel")
    dist_dir, env_dir, work = base / "dist", base / "venv", base / "work"
    work.mkdir()
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                  "-q", "-w", str(dist_dir), str(ROOT)], cwd=work)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist_dir.glob("megatron_hcp-*.whl")
    venv.create(env_dir, with_pip=False)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir),
                                                    "platbase": str(env_dir)}))
    # the test environment's packages (torch, megatron-core) after the venv's own
    (site / "zz_test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = [str(env_dir / "bin" / "python"), "-m", "pip"]
    install = _run([sys.executable, "-m", "pip", "--python", pip[0], "install", "--no-deps",
                    "-q", str(wheel)], cwd=work)
    assert install.returncode == 0, install.stderr
    return env_dir / "bin", work


def test_the_wheel_carries_recipes_and_diffs(wheel_env):
    bin_dir, work = wheel_env
    where = _run([str(bin_dir / "python"), "-c",
                  "import megatron_hcp, megatron_hcp.files.data as d; "
                  "print(megatron_hcp.__file__); "
                  "print(d.data_dir('recipes')); print(d.data_dir('patches'))"], cwd=work)
    assert where.returncode == 0, where.stderr
    package, recipes, patches = where.stdout.split()
    venv_dir = str(bin_dir.parent)
    assert package.startswith(venv_dir) and not package.startswith(str(ROOT))
    assert recipes.startswith(venv_dir) and patches.startswith(venv_dir)
    listed = _run([str(bin_dir / "megatron-hcp"), "functional", "list"], cwd=work)
    assert listed.returncode == 0, listed.stderr
    shipped = sorted(p.name for p in (ROOT / "tests/functional/test_cases").iterdir()
                     if (p / "model_config.yaml").is_file())
    assert [line.split()[0] for line in listed.stdout.splitlines()] == shipped


def test_the_wheel_checks_a_megatron_tree(wheel_env, tmp_path):
    import megatron.core

    bin_dir, work = wheel_env
    target = tmp_path / "megatron"
    shutil.copytree(Path(megatron.core.__file__).resolve().parent.parent, target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    check = _run([str(bin_dir / "megatron-hcp"), "patch", "check", "--target", str(target)],
                 cwd=work)
    assert check.returncode == 0, check.stderr
    lines = check.stdout.splitlines()
    assert lines[0].startswith("megatron-core ")
    assert sum("applicable" in line for line in lines) >= 18, check.stdout


def test_the_wheel_runs_a_recipe(wheel_env):
    bin_dir, work = wheel_env
    # forked ranks: the imports once (torchrun's ranks: test_forked_launch, bit for bit alike)
    run = _run([str(bin_dir / "megatron-hcp"), "functional", "run",
                "gpt3_mcore_tp1_pp1_cp4_a2a", "--launcher", "forkserver"], cwd=work, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASS" in run.stdout and "CP invariance: PASS" in run.stdout, run.stdout[-3000:]
