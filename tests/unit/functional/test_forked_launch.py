"""The forkserver launcher (``--launcher forkserver``): ranks forked from a process that has
imported torch and megatron-core get torchrun's environment, train a recipe exactly as
torchrun's ranks do, and fail like torchrun (the first failure stops the others, its rank
named)."""

from __future__ import annotations

import time

import pytest

from megatron_hcp.functional.forked import run_forked
from megatron_hcp.functional.harness import recipe_dir, run_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

TARGET = "tests.unit.functional._forked_target"
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_ranks_get_torchruns_environment_and_their_lines_come_live():
    live: list[str] = []
    code, lines = run_forked(TARGET, ["ok"], 3, ENV, on_line=live.append)
    assert code == 0, lines
    for r in range(3):
        assert (f"[rank{r}]: rank={r} world=3 local={r} addr=127.0.0.1 cuda='' threads=1 "
                "argv=['ok']\n") in lines, lines
        assert f"[rank{r}]: sum=3\n" in lines, lines
    assert sorted(live) == sorted(line.split(": ", 1)[1].rstrip("\n") for line in lines
                                  if line.startswith("[rank")) and len(live) == 9, live
    # prefork ran once, in the process the ranks were forked from
    pids = [line.split()[1:] for line in lines if " prefork=" in line]
    assert len(pids) == 3 and len({p[0] for p in pids}) == 1, pids
    assert pids[0][0].replace("prefork", "pid") not in {p[1] for p in pids}


def test_a_failing_prefork_is_the_runs_failure_and_shown():
    code, lines = run_forked(TARGET, ["fail-prefork"], 2, ENV)
    assert code == 1 and "[launcher]: RuntimeError: prefork planted\n" in lines, lines


def test_the_exit_code_of_main_is_the_runs():
    assert run_forked(TARGET, ["exit-3"], 2, ENV)[0] == 3


def test_a_failing_rank_stops_the_others_and_is_named():
    start = time.monotonic()
    code, lines = run_forked(TARGET, ["fail-on", "1"], 3, ENV, timeout_s=300)
    assert code == 1
    assert "[rank1]: ValueError: rank 1 planted\n" in lines, lines
    assert not any(line.startswith("[rank0]: sum=") for line in lines), lines
    assert time.monotonic() - start < 60  # stopped after the grace period, not the deadline


def test_the_deadline_stops_every_rank():
    start = time.monotonic()
    code, _ = run_forked(TARGET, ["sleep", "120"], 2, ENV, timeout_s=2)
    assert code == 124 and time.monotonic() - start < 30


def test_both_launchers_train_a_recipe_bit_for_bit_alike():
    recipe = load_recipe(recipe_dir("gpt3_mcore_tp1_pp1_cp4_p2p"))
    runs = [run_recipe(recipe, steps=3, echo=None, launch=Launch(launcher=launcher))
            for launcher in ("torchrun", "forkserver")]
    for name in ("lm loss", "grad norm", "num-zeros", "micro-batches"):
        assert runs[0][name] == runs[1][name] and len(runs[0][name]) == 3, name


def _gone(pid: int) -> bool:
    """The process has ended (absent, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_ctrl_c_while_waiting_stops_every_rank():
    pids: list[int] = []

    def interrupt(line: str) -> None:
        pids.append(int(line.split("=")[1]))
        if len(pids) == 2:
            raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_forked(TARGET, ["sleep", "120"], 2, ENV, on_line=interrupt)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids) and time.monotonic() - start < 60, pids


_DEEP_TMPDIR_CHILD = """
import multiprocessing as mp, os, sys
from megatron_hcp.functional.forked import _AF_UNIX_PATH_MAX, _multiprocessing_temp_dir
folder = _multiprocessing_temp_dir()
assert len(os.fsencode(os.path.join(folder, "listener-" + "x" * 8))) < _AF_UNIX_PATH_MAX, folder
ctx = mp.get_context("forkserver")
child = ctx.Process(target=os.getpid)
child.start()  # the forkserver's socket lives in that folder
child.join()
print("FOLDER", folder, child.exitcode)
"""


def test_a_deep_tmpdir_does_not_stop_the_forkserver(tmp_path):
    """The forkserver's socket lives in multiprocessing's temporary folder; under a deep
    ``$TMPDIR`` its path passed AF_UNIX's 107 bytes and the launch failed ('AF_UNIX path too
    long'): the folder then goes to /tmp."""
    import os
    import subprocess
    import sys

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(deep)}
    done = subprocess.run([sys.executable, "-c", _DEEP_TMPDIR_CHILD], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    folder, code = done.stdout.split()[-2:]
    assert code == "0" and not folder.startswith(str(deep)), done.stdout
