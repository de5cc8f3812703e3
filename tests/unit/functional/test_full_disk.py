"""A full (or over-quota, or read-only) file system is one line naming the path, never a
traceback: output folders are probed before any work, a write refused at write time raises
OutputWriteError in the writer itself (nothing partial is left), the command line prints it and
exits 1; the standard output too (``> /dev/full``). A failed run's error ends with each failing
rank's exception line.

The full disk is made in this process (``os.write``/``os.fsync``/``savefig`` refusing the
test's own files with ENOSPC), and, where this machine lets a test mount one, a real full
tmpfs."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_hcp import cli
from megatron_hcp.files.atomic_write import (
    OutputPathError,
    OutputWriteError,
    check_output_dir,
    check_output_file,
    save_figure,
    write_atomic,
)
from megatron_hcp.functional import harness
from megatron_hcp.functional.harness import RecipeResult, failure_summary, rank_exceptions
from megatron_hcp.functional.recipe import RECIPES_DIR

RECIPE = "gpt3_mcore_tp1_pp1_cp4_p2p"
REFUSED = [errno.ENOSPC, errno.EDQUOT, errno.EROFS]
SAYS = {errno.ENOSPC: "the file system is full (ENOSPC)",
        errno.EDQUOT: "the disk quota is exceeded (EDQUOT)",
        errno.EROFS: "the file system is read-only (EROFS)"}
SCHEDULE = ["schedule", "--dp-cp", "4", "--max-seqlen-per-rank", "2048"]
PLAN = ["plan", "--layers", "4", "--hidden", "512", "--ffn", "2048", "--heads", "8",
        "--vocab", "32000", "--seq-length", "8192", "--global-batch", "8", "--nodes", "1"]


def _refuse_under(monkeypatch, folder: Path, code: int = errno.ENOSPC) -> None:
    """``os.write`` and ``os.fsync`` on files under ``folder`` fail with ``code`` (the file
    system there is full); every other file works as before."""
    def under(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:
            return False

    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):
        if under(fd):
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd):
        if under(fd if isinstance(fd, int) else fd.fileno()):
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- the writer: a refused write is named, nothing partial is left ---------------------------

@pytest.mark.parametrize("code", REFUSED)
def test_a_refused_atomic_write_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch,
                                                                      code):
    path = tmp_path / "golden_values_dev_cpu_gloo.json"
    path.write_text("the old values")
    _refuse_under(monkeypatch, tmp_path, code)
    with pytest.raises(OutputWriteError) as info:
        write_atomic(path, "new values " * 1000)
    err = info.value
    assert isinstance(err, OSError) and err.errno == code and err.filename == str(path)
    assert str(err) == (f"cannot write {str(path)!r}: {SAYS[code]}; free space there or write "
                        "elsewhere")
    assert path.read_text() == "the old values"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file


def test_other_write_errors_pass_unchanged(tmp_path, monkeypatch):
    _refuse_under(monkeypatch, tmp_path, errno.EIO)
    with pytest.raises(OSError) as info:
        write_atomic(tmp_path / "x.json", "{}")
    assert type(info.value) is OSError and info.value.errno == errno.EIO


class _HalfWritten:
    """A figure whose file system fills up halfway through ``savefig``."""

    def savefig(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_figure_on_a_full_disk_is_named_and_leaves_nothing(tmp_path):
    path = tmp_path / "plan.png"
    with pytest.raises(OutputWriteError, match=r"cannot write '.*plan\.png': the file system "
                                               r"is full \(ENOSPC\)"):
        save_figure(_HalfWritten(), path)
    assert list(tmp_path.iterdir()) == []


# --- the checks: a full disk is refused before any work --------------------------------------

def test_output_checks_probe_the_disk(tmp_path, monkeypatch):
    assert check_output_file(tmp_path / "p.png", "--plot") == tmp_path / "p.png"
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    _refuse_under(monkeypatch, tmp_path)
    rule = (f"cannot write into {str(tmp_path)!r}: the file system is full (ENOSPC); free "
            "space there or give another path")
    with pytest.raises(OutputPathError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        check_output_file(tmp_path / "p.png", "--plot")
    with pytest.raises(OutputPathError, match="--plot .*the file system is full"):
        check_output_dir(tmp_path / "new" / "plots", "--plot")  # created later, here
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [[*SCHEDULE, "--lengths", "{lengths}", "--plot", "{out}/p.png"],
                                  [*PLAN, "--plot", "{out}/p.png"],
                                  ["functional", "run", RECIPE, "--plot", "{out}/plots"]])
def test_a_plot_into_a_full_disk_is_refused_before_any_work(tmp_path, monkeypatch, capsys,
                                                            argv):
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[4096, 812, 300, 2000]")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(harness, "check_recipe", _no_training)
    _refuse_under(monkeypatch, out)
    argv = [a.format(lengths=lengths, out=out) for a in argv]
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--plot '{out}" in line and "the file system is full (ENOSPC)" in line, line
    assert list(out.iterdir()) == []


def _no_training(*args, **kwargs):
    raise AssertionError("trained although the output was refused")


# --- at write time: the command line's one line, exit 1 --------------------------------------

def test_a_plot_refused_after_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    loss = {s: 4.8 - 0.1 * s for s in range(1, 4)}
    monkeypatch.setattr(harness, "check_recipe", lambda recipe, **kw: RecipeResult(
        recipe.name, 3, True, loss=loss, golden_loss=dict(loss)))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _HalfWritten.savefig)
    plots = tmp_path / "plots"
    assert cli.main(["functional", "run", RECIPE, "--plot", str(plots)]) == 1
    out, err = capsys.readouterr()
    assert _one_line(err) == (f"megatron-hcp functional: error: cannot write "
                              f"'{plots / (RECIPE + '.png')}': the file system is full (ENOSPC); "
                              "free space there or write elsewhere")
    assert list(plots.iterdir()) == []


def _recipe_copy(tmp_path: Path) -> Path:
    folder = tmp_path / RECIPE
    shutil.copytree(RECIPES_DIR / RECIPE, folder)
    return folder


def _finished_run(recipe, **kwargs):
    steps = range(1, recipe.steps + 1)
    return {name: {s: 4.0 + s / 100 for s in steps}
            for name in ("lm loss", "num-zeros", "iteration-time", "mem-allocated-bytes")}


def test_update_golden_refused_at_write_time_is_one_line(tmp_path, monkeypatch, capsys):
    folder = _recipe_copy(tmp_path)
    golden = folder / "golden_values_dev_cpu_gloo.json"
    before = golden.read_bytes()
    real_write_atomic = harness.replace_golden.__globals__["write_atomic"]

    def full_at_write(path, data, **kwargs):  # the disk fills up during training
        _refuse_under(monkeypatch, folder)
        return real_write_atomic(path, data, **kwargs)

    monkeypatch.setitem(harness.replace_golden.__globals__, "write_atomic", full_at_write)
    monkeypatch.setattr(harness, "run_recipe", _finished_run)
    assert cli.main(["functional", "update-golden", str(folder), "--platform", "cpu_gloo"]) == 1
    assert _one_line(capsys.readouterr().err) == (
        f"megatron-hcp functional: error: cannot write '{golden}': the file system is full "
        "(ENOSPC); free space there or write elsewhere")
    assert golden.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (RECIPES_DIR / RECIPE).iterdir())  # no temporary or lock file


def test_update_golden_into_a_full_disk_is_refused_before_training(tmp_path, monkeypatch,
                                                                    capsys):
    folder = _recipe_copy(tmp_path)
    monkeypatch.setattr(harness, "run_recipe", _no_training)
    _refuse_under(monkeypatch, folder)
    assert cli.main(["functional", "update-golden", str(folder), "--platform", "cpu_gloo"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"golden values {folder / 'golden_values_dev_cpu_gloo.json'}: "
                           f"the golden values' folder '{folder}': cannot write into "), line
    assert "the file system is full (ENOSPC)" in line


# --- the standard output ---------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["layout", "--world-size", "8", "--context-parallel-size",
                                   "4", "--json"], [*PLAN, "--json"]])
def test_json_to_dev_full_is_one_line_and_exit_1(monkeypatch, capsys, argv):
    with open("/dev/full", "w", encoding="utf-8") as full:
        monkeypatch.setattr("sys.stdout", full)
        code = cli.main(argv)
    assert code == 1
    assert _one_line(capsys.readouterr().err) == (
        f"megatron-hcp {argv[0]}: error: cannot write the standard output: the file system is "
        "full (ENOSPC); free space there or write elsewhere")


# --- a real full file system, where a test may mount one -------------------------------------

@pytest.fixture
def full_tmpfs(tmp_path):
    """A folder on a 64 KiB tmpfs filled to the last byte (needs the right to mount)."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
        capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (the in-process tests cover the same paths)")
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_real_full_disk_is_refused_before_any_work(full_tmpfs, tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([4096, 812, 300, 2000]))
    for argv in ([*SCHEDULE, "--lengths", str(lengths), "--plot", str(full_tmpfs / "p.png")],
                 [*PLAN, "--plot", str(full_tmpfs / "p.png")],
                 ["functional", "run", RECIPE, "--plot", str(full_tmpfs / "plots")]):
        assert cli.main(argv) == 2, argv
        line = _one_line(capsys.readouterr().err)
        assert "the file system is full (ENOSPC)" in line, line
    assert sorted(os.listdir(full_tmpfs)) == ["filler"]


def test_a_real_full_disk_at_write_time_is_named(full_tmpfs):
    with pytest.raises(OutputWriteError, match="the file system is full"):
        write_atomic(full_tmpfs / "golden.json", "x" * 100_000)
    assert sorted(os.listdir(full_tmpfs)) == ["filler"]


# --- a failed run's error ends with its cause ------------------------------------------------

TORCHRUN_LOG = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/w.py", line 11, in <module>
[rank1]:     deep(30)
[rank1]:   [Previous line repeated 27 more times]
[rank1]: OSError: [Errno 28] No space left on device: '/tmp/x1'

[rank1]: The above exception was the direct cause of the following exception:

[rank1]: Traceback (most recent call last):
[rank1]:     raise RuntimeError("wrapped") from e
[rank1]: RuntimeError: wrapped
rank 0 line 1
[rank0]: Traceback (most recent call last):
[rank0]:   File "/w.py", line 3, in <module>
[rank0]: torch.distributed.DistBackendError: [../gloo/transport.cc:1] Connection closed by peer
Traceback (most recent call last):
  File "/venv/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
============================================================
""" + "".join(f"  noise line {i}\n" for i in range(60))


def test_each_failing_ranks_exception_ends_the_summary():
    log = TORCHRUN_LOG.splitlines(keepends=True)
    assert rank_exceptions(log) == [
        "[rank0]: torch.distributed.DistBackendError: [../gloo/transport.cc:1] Connection "
        "closed by peer",
        "[rank1]: RuntimeError: wrapped"]
    summary = failure_summary(log)
    assert "RuntimeError" not in summary.split("each failing rank's exception:")[0]  # the tail
    assert summary.splitlines()[-3:] == ["each failing rank's exception:", *rank_exceptions(log)]


def test_unprefixed_and_cpp_failures_are_named_too():
    log = ["Traceback (most recent call last):\n", "  File \"/w.py\", line 1\n",
           "ModuleNotFoundError: No module named 'x'\n",
           "[rank2]: terminate called after throwing an instance of 'c10::Error'\n",
           "[rank2]:   what():  [enforce fail at gloo/pair.cc:1] op.preamble.length\n",
           "[launcher]: Traceback (most recent call last):\n",
           "[launcher]: RuntimeError: prefork planted\n"]
    assert rank_exceptions(log) == [
        "[rank2]: what():  [enforce fail at gloo/pair.cc:1] op.preamble.length",
        "[rank?]: ModuleNotFoundError: No module named 'x'",
        "[launcher]: RuntimeError: prefork planted"]
    quiet = ["E1129 failed (exitcode: -9) local_rank: 0\n"]
    assert rank_exceptions(quiet) == [] and failure_summary(quiet).endswith("local_rank: 0\n")
