"""How a run ends, with processes.

A run ends with the command that runs it: SIGTERM (what Slurm, Kubernetes or a CI time-out send
before SIGKILL), SIGHUP and SIGINT sent to ``megatron-hcp functional run`` alone end the
launcher (torchrun, or the forkserver's zygote), every rank and the ranks' own children, remove
the run's temporary folders (nothing of the run is left in ``$TMPDIR``) and exit 128 + the
signal's number. A failed run's error ends with each failing rank's exception line. A full
standard output is one line. A second ``update-golden`` of a golden file that another process
is regenerating is refused at once, naming that process.

The ranks are a stand-in worker (``_ending_target``: records its processes and waits), started
through the real command line, launchers and signal handling (``_ending_cli``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hcp.functional.harness import RecipeRunError, recipe_dir, run_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]
RECIPE = "gpt3_mcore_tp1_pp1_cp4_p2p"  # 4 ranks
NPROC = 4
TARGET = "tests.unit.functional._ending_target"


def _running(pid: int) -> bool:
    """The process runs (it exists and is no zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _marked(marker: bytes) -> list[int]:
    """Running processes whose environment holds ``marker`` (every process of one run: the
    command, torchrun or the forkserver, each rank and the ranks' children)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in Path(entry.path, "environ").read_bytes() and _running(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.fixture
def run_env(tmp_path):
    """The command's environment: a fresh ``$TMPDIR`` and the stand-in's record folder (its
    path, in every process's environment, marks the processes of this run); whatever of the
    run still runs at the end is killed by pid."""
    tmp, records = tmp_path / "tmp", tmp_path / "records"
    tmp.mkdir()
    records.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "ENDING_TARGET_DIR": str(records),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("ENDING_TARGET_MODE", None)
    marker = f"ENDING_TARGET_DIR={records}".encode() + b"\0"
    yield env, tmp, records, marker
    for pid in _marked(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for_ranks(records: Path, proc: subprocess.Popen, timeout: float = 300) -> list[dict]:
    """Each rank's record, once every rank has written it (the ranks are running)."""
    deadline = time.monotonic() + timeout
    while len(list(records.glob("rank?"))) < NPROC:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended ({proc.returncode}) before its ranks ran:\n{err}")
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return [json.loads((records / f"rank{r}").read_text()) for r in range(NPROC)]


@pytest.mark.parametrize("launcher, signum", [
    ("torchrun", signal.SIGTERM), ("torchrun", signal.SIGHUP), ("torchrun", signal.SIGINT),
    ("forkserver", signal.SIGTERM), ("forkserver", signal.SIGHUP),
])
def test_a_signal_to_the_command_ends_every_process_of_the_run(run_env, launcher, signum):
    env, tmp, records, marker = run_env
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.functional._ending_cli", "functional", "run", RECIPE,
         "--no-cp1", "--launcher", launcher],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = _wait_for_ranks(records, proc)
        proc.send_signal(signum)  # to the command alone, as Kubernetes or `kill PID` send it
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signum, err
    said = ("megatron-hcp: interrupted" if signum == signal.SIGINT else
            f"megatron-hcp: terminated by {signal.Signals(signum).name}; the run's processes "
            "and temporary files are gone")
    assert err.strip().splitlines()[-1] == said, err
    # the ranks, their launcher and the ranks' children have gone when the command exits
    pids = [r[key] for r in ranks for key in ("pid", "parent", "child")]
    assert [p for p in pids if _running(p)] == [], err
    deadline = time.monotonic() + 15  # the forkserver ends when it sees the command gone
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(marker) == []
    # torchinductor's cache was the run's own; nothing of the run is left in $TMPDIR
    assert all(Path(r["inductor"]).parent.parent == tmp for r in ranks), ranks
    assert all(Path(r["inductor"]).parent.name.startswith("megatron-hcp-") for r in ranks)
    assert sorted(os.listdir(tmp)) == []


@pytest.mark.parametrize("launcher", ["torchrun", "forkserver"])
def test_a_failed_runs_error_ends_with_each_failing_ranks_exception(run_env, monkeypatch,
                                                                    launcher):
    env, tmp, _, _ = run_env
    for name in ("TMPDIR", "ENDING_TARGET_DIR", "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("ENDING_TARGET_MODE", "fail")
    recipe = dataclasses.replace(load_recipe(recipe_dir(RECIPE)), worker=TARGET)
    with pytest.raises(RecipeRunError) as info:
        run_recipe(recipe, steps=1, echo=None, launch=Launch(launcher=launcher))
    lines = str(info.value).splitlines()
    assert lines[-3:] == ["each failing rank's exception:",
                          "[rank1]: RuntimeError: rank 1 could not save",
                          "[rank3]: RuntimeError: rank 3 could not save"], str(info.value)
    assert [p for p in os.listdir(tmp) if p.startswith(("megatron-hcp", "torch"))] == []


def test_a_full_standard_output_is_one_line_and_exit_1():
    with open("/dev/full", "w", encoding="utf-8") as full:
        proc = subprocess.run([sys.executable, "-m", "megatron_hcp.cli", "layout",
                               "--world-size", "8", "--context-parallel-size", "4", "--json"],
                              cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megatron-hcp layout: error: cannot write the standard output: the file system is "
        "full (ENOSPC); free space there or write elsewhere"], proc.stderr


HOLDER = """
import sys, time
from megatron_hcp.functional.golden import golden_lock
with golden_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


def test_update_golden_is_refused_while_another_process_updates_the_file(tmp_path, monkeypatch,
                                                                           capsys):
    import shutil

    from megatron_hcp import cli
    from megatron_hcp.functional import harness
    from megatron_hcp.functional.recipe import RECIPES_DIR

    folder = tmp_path / RECIPE
    shutil.copytree(RECIPES_DIR / RECIPE, folder)
    golden = folder / "golden_values_dev_cpu_gloo.json"
    before = golden.read_bytes()

    def no_training(*args, **kwargs):
        raise AssertionError("trained beside another update")

    monkeypatch.setattr(harness, "run_recipe", no_training)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(golden)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        start = time.monotonic()
        assert cli.main(["functional", "update-golden", str(folder), "--platform",
                         "cpu_gloo"]) == 1
        assert time.monotonic() - start < 30  # refused at once, not after waiting
        assert capsys.readouterr().err.strip().splitlines() == [
            f"golden values {golden}: another update-golden run (pid {holder.pid}) holds its "
            f"lock {golden}.lock; wait for it to finish, or end it, and run again"]
    finally:
        holder.communicate(input="", timeout=60)
    assert holder.returncode == 0 and golden.read_bytes() == before
    assert not Path(f"{golden}.lock").exists()
