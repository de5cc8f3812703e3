"""Fork-style patches: drift guard, atomic check/apply/revert, equality with the runtime form."""

from __future__ import annotations

import compileall
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_hcp.cli import main as cli_main
from megatron_hcp.harness.local_world import LocalWorld
from megatron_hcp.patching import ALL_PATCHES, PatchError, megatron_core_version
from megatron_hcp.patching.forkpatch import (
    PATCHES_DIR,
    SERIES,
    apply_diffs,
    check_diffs,
    diff_digest,
    diff_versions,
    read_header,
    revert_diffs,
    runtime_digest,
    series_for,
)
from tests.unit.patching._fork_worker import WORLD, import_megatron, train_with
from tests.unit.patching.test_patch_transactions import refused

VERSIONS = sorted({v for p in ALL_PATCHES for v in p.versions})
INSTALLED = megatron_core_version()


# ---------------------------------------------------------------- drift guard
def test_every_supported_version_has_diffs():
    assert VERSIONS == diff_versions() == ["0.16.1", "0.19.2"]
    assert INSTALLED in VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_every_runtime_patch_has_its_diff_and_nothing_else(version):
    files = sorted((PATCHES_DIR / f"megatron-core-{version}").glob("*.patch"))
    names = [f.name.split("-", 1)[1].removesuffix(".patch") for f in files]
    assert names == series_for(version)  # numbered in series order
    assert sorted(names) == sorted(p.name for p in ALL_PATCHES if p.needed(version))
    assert set(SERIES) == {p.name for p in ALL_PATCHES}


@pytest.mark.parametrize("version", VERSIONS)
def test_diffs_match_the_current_runtime_patches(version):
    """Changing a runtime patch without regenerating its diff (or editing a diff by hand)
    fails here: regenerate with `.venv/bin/python patches/generate.py` and review both."""
    table = {p.name: p for p in ALL_PATCHES}
    for file in sorted((PATCHES_DIR / f"megatron-core-{version}").glob("*.patch")):
        header = read_header(file)
        patch = table[header["Patch-Name"]]
        assert header["Runtime-Digest"] == runtime_digest(patch, version), (
            f"{patch.name}: runtime patch changed since {file.name} was generated")
        assert header["Diff-Digest"] == diff_digest(header["body"]), (
            f"{file.name}: diff edited by hand (digest mismatch)")
        assert header["Megatron-Core-Versions"] == ", ".join(patch.versions)
        # the diff touches an upstream file the runtime patch names (one per release where a
        # module moved: 0.16's ssm/mamba_block.py is 0.19's models/hybrid/hybrid_block.py)
        named = re.findall(r"megatron/[\w/]+\.py", patch.upstream)
        assert named and any(f"b/{path}" in header["body"] for path in named), file.name
        # every file it edits carries the marker applied_in_source looks for
        for block in header["body"].split("diff --git ")[1:]:
            added = "".join(ln for ln in block.splitlines(keepends=True) if ln.startswith("+"))
            assert "new file mode" in block or f"megatron-hcp {patch.name}" in added, (
                file.name, block.split()[0])


# ---------------------------------------------------------------- command
def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted((root / "megatron").rglob("*.py"))}


def test_check_apply_revert_round_trip(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    before = snapshot(target)
    series = series_for(INSTALLED)
    version, status = check_diffs(target / "megatron")  # installed-package form of the path
    assert version == INSTALLED
    assert {s.name: s.state for s in status if s.has_diff} == dict.fromkeys(series, "applicable")
    fixed = {s.name: s.state for s in status if not s.has_diff}
    assert fixed == {p.name: p.status(INSTALLED) for p in ALL_PATCHES
                     if p.fixed_upstream(INSTALLED) or not p.targets_for(INSTALLED)
                     or not p.supports(INSTALLED)}
    assert all(state.startswith(("fixed upstream in", "nothing to change",
                                 "not written for this version"))
               for state in fixed.values())
    assert apply_diffs(target) == series
    assert {s.state for s in check_diffs(target)[1] if s.has_diff} == {"applied"}
    assert apply_diffs(target) == []  # idempotent
    assert (target / "megatron" / "core" / "cpu_runtime.py").is_file()
    assert revert_diffs(target) == list(reversed(series))
    assert snapshot(target) == before  # byte-identical original


def test_refuses_other_versions_and_conflicts_atomically(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    info = target / "megatron" / "core" / "package_info.py"
    original = info.read_text()
    minor = INSTALLED.split(".")[1]
    info.write_text(original.replace(f"MINOR = {minor}", "MINOR = 15"))
    other = f"0.15.{INSTALLED.split('.')[2]}"
    with pytest.raises(PatchError, match=f"no fork patches for megatron-core {other}"):
        apply_diffs(target)
    with pytest.raises(PatchError, match=f"no fork patches for megatron-core {other}"):
        revert_diffs(target)
    info.write_text(original)
    # a local edit where one diff lands: that diff conflicts, nothing at all is applied
    attention = target / "megatron" / "core" / "transformer" / "attention.py"
    attention.write_text(attention.read_text().replace(
        "            q_pos_emb, k_pos_emb = rotary_pos_emb\n\n            if packed_seq_params",
        "            q_pos_emb, k_pos_emb = rotary_pos_emb  # local change\n\n"
        "            if packed_seq_params", 1))
    before = snapshot(target)
    status = {s.name: s.state for s in check_diffs(target)[1]}
    assert status["attention-dynamic-cp-rope"] == "conflicts"
    with pytest.raises(PatchError, match="attention-dynamic-cp-rope conflicts"):
        apply_diffs(target)
    assert snapshot(target) == before
    with pytest.raises(PatchError, match="neither a Megatron-LM checkout"):
        check_diffs(tmp_path)


@pytest.mark.multirank
def test_a_target_inside_another_git_work_tree_is_really_patched(pristine, tmp_path):
    """git apply skips every path of a target inside another repository and succeeds; the
    engine does not use git: "applied" is only said of files that carry the change."""
    repo = tmp_path / "repo"
    shutil.copytree(pristine, repo)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = snapshot(repo)
    assert {s.state for s in check_diffs(repo)[1] if s.has_diff} == {"applicable"}
    assert apply_diffs(repo) == series_for(INSTALLED)
    attention = (repo / "megatron/core/transformer/attention.py").read_text()
    assert "megatron-hcp attention-dynamic-cp-rope" in attention
    assert snapshot(repo) != before
    assert {s.state for s in check_diffs(repo)[1] if s.has_diff} == {"applied"}
    revert_diffs(repo)
    assert snapshot(repo) == before


def test_revert_of_an_edited_region_changes_nothing_and_names_it(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    apply_diffs(target)
    attention = target / "megatron/core/transformer/attention.py"
    text = attention.read_text()
    line = next(ln for ln in text.splitlines() if "rope_cp_group = self.pg_collection.cp" in ln)
    attention.write_text(text.replace(line, line + "  # edited after patching", 1))
    before = snapshot(target)
    states = {s.name: s.state for s in check_diffs(target)[1]}
    assert states["attention-dynamic-cp-rope"] == "conflicts"
    with pytest.raises(PatchError, match="cannot revert attention-dynamic-cp-rope .*"
                       "megatron/core/transformer/attention.py.* nothing was changed"):
        revert_diffs(target)
    assert snapshot(target) == before


def touched(root: Path) -> list[Path]:
    """The existing files the installed version's diffs edit."""
    paths = set()
    for file in sorted((PATCHES_DIR / f"megatron-core-{INSTALLED}").glob("*.patch")):
        paths |= set(re.findall(r"^diff --git a/(\S+)", read_header(file)["body"], re.M))
    return [root / p for p in sorted(paths) if (root / p).is_file()]


def test_crlf_files_stay_crlf_and_revert_gives_back_the_same_bytes(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    files = touched(target)
    for file in files:
        file.write_bytes(file.read_bytes().replace(b"\n", b"\r\n"))
    before = snapshot(target)
    assert apply_diffs(target) == series_for(INSTALLED)
    for file in files:
        data = file.read_bytes()
        assert b"megatron-hcp" in data and data.count(b"\n") == data.count(b"\r\n"), file
    assert {s.state for s in check_diffs(target)[1] if s.has_diff} == {"applied"}
    assert revert_diffs(target) == list(reversed(series_for(INSTALLED)))
    assert snapshot(target) == before  # byte-identical, CRLF included


def test_a_file_a_diff_changes_that_is_not_utf8_is_refused_before_any_write(
        pristine, tmp_path, capsys):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    attention = target / "megatron/core/transformer/attention.py"
    for patched in (False, True):
        if patched:
            attention.write_bytes(attention.read_bytes()[:-len(b"# caf\xe9\n")])
            apply_diffs(target)
        attention.write_bytes(attention.read_bytes() + b"# caf\xe9\n")  # Latin-1
        before = snapshot(target)
        for command in ("check", "apply", "revert"):
            code = cli_main(["patch", command, "--target", str(target)])
            refused(code, capsys.readouterr().err, str(attention), "not UTF-8")
            assert snapshot(target) == before, (patched, command)
    assert not list((target / "megatron").glob(".megatron-hcp-patch.*"))


def test_files_the_diffs_do_not_change_may_hold_any_bytes(pristine, tmp_path, capsys):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    latin1 = b"Metadata-Version: 2.1\nName: megatron-core\nAuthor: Jos\xe9\n"
    for where in ("PKG-INFO", "megatron/PKG-INFO", "megatron_core.egg-info/PKG-INFO",
                  "megatron/core/README-latin1.txt"):
        (target / where).parent.mkdir(exist_ok=True)
        (target / where).write_bytes(latin1)
    info = target / "megatron/core/package_info.py"  # read for the version only
    info.write_bytes(info.read_bytes() + b"# Jos\xe9\n")
    before = snapshot(target)
    for command in ("check", "apply", "check", "revert"):
        assert cli_main(["patch", command, "--target", str(target)]) == 0, command
        assert capsys.readouterr().err == "", command
    assert snapshot(target) == before and (target / "PKG-INFO").read_bytes() == latin1


# every megatron-core release on the package index from the oldest to the newest supported one
RELEASES = ("0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2")


# released wheels never change: kept between runs and stacks (ignored by git)
WHEEL_CACHE = Path(__file__).resolve().parents[3] / ".cache" / "wheels"


def release_wheel(version: str, scratch: Path) -> Path:
    """megatron-core ``version``'s wheel from the package index, downloaded once into
    :data:`WHEEL_CACHE` (through ``scratch``, then renamed: never a partial file there)."""
    cached = sorted(WHEEL_CACHE.glob(f"megatron_core-{version}-*.whl"))
    if cached:
        return cached[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--no-cache-dir", "--only-binary=:all:", "--python-version", "3.12",
                    "-d", str(scratch), f"megatron-core=={version}"], check=True)
    (wheel,) = scratch.glob("*.whl")
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    return Path(shutil.move(str(wheel), WHEEL_CACHE / wheel.name))


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Each release's ``megatron`` package, unpacked from its wheel on the package index."""
    out = {}
    for version in RELEASES:
        where = tmp_path_factory.mktemp(f"mcore-{version}")
        wheel = release_wheel(version, where)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(where / "src", [n for n in zf.namelist() if n.startswith("megatron/")])
        out[version] = where / "src"
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_check_reports_every_release_and_writes_nothing(releases, version, capsys):
    root = releases[version]
    before = snapshot(root)
    assert cli_main(["patch", "check", "--target", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"megatron-core {version} at {root}"
    states = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert len(states) == len(SERIES)
    for patch in ALL_PATCHES:
        label = next(k for k in states if patch.name in k)
        if patch.fixed_upstream(version):
            assert states[label] == f"fixed upstream in {patch.fixed_in}"
        elif version in VERSIONS and not patch.supports(version):  # written for another
            assert states[label] == "not written for this version", (patch.name, states[label])
        elif version in VERSIONS and not patch.targets_for(version):  # its code is not there
            assert states[label].startswith("nothing to change"), (patch.name, states[label])
        elif version in VERSIONS:
            assert states[label] == "applicable", (patch.name, states[label])
        else:
            assert states[label] == "not written for this version"
    if version not in VERSIONS:  # apply and revert refuse it
        for command in ("apply", "revert"):
            assert cli_main(["patch", command, "--target", str(root)]) == 2
            assert "no fork patches for megatron-core" in capsys.readouterr().err
    assert snapshot(root) == before


# ---------------------------------------------------------------- equality of the two forms
@pytest.fixture(scope="module")
def patched_world(pristine):
    apply_diffs(pristine)
    compileall.compile_dir(pristine, quiet=1)  # once here, not by every rank at once
    # fresh interpreters (not the shared forkserver, which may have imported megatron already):
    # each rank imports megatron from the patched copy, first and with room for a cold import
    with LocalWorld(WORLD, start_method="spawn") as w:
        where = w.run(import_megatron, str(pristine), timeout_s=600)
        assert all(path.startswith(str(pristine)) for path in where), where
        yield w, str(pristine)


@pytest.fixture(scope="module")
def runtime_world():
    with LocalWorld(WORLD) as w:
        yield w


@pytest.mark.parametrize("cp, comm, hcp, pp, dynamic", [
    (4, "a2a+p2p", [2, 2], 1, False), (2, "all_gather", None, 2, False), (2, "p2p", None, 2, True)])
@pytest.mark.multirank
def test_diffs_train_exactly_like_the_runtime_patches(patched_world, runtime_world, cp, comm,
                                                      hcp, pp, dynamic):
    world, source = patched_world
    forked = world.run(train_with, source, cp, comm, hcp, pp, dynamic)
    runtime = runtime_world.run(train_with, None, cp, comm, hcp, pp, dynamic)
    for f, r in zip(forked, runtime):
        assert f["where"].startswith(source) and not f["applied"]  # the diffs alone
        assert "cpu-schedules-device" in r["applied"]
        assert f["loss"] == r["loss"] and f["grad_norm"] == r["grad_norm"], (f, r)


@pytest.mark.multirank
def test_the_forked_moe_router_equals_one_rank_holding_the_micro_batch(patched_world):
    """``moe-router-dynamic-cp-group`` as a diff (no runtime patching): a dynamic-CP
    micro-batch's router losses equal one rank's over the whole micro-batch, as the runtime
    patch's do (test_moe_router_patch.py)."""
    from tests.unit.patching.test_moe_router_patch import router_per_micro_batch

    world, _ = patched_world
    for result in world.run(router_per_micro_batch, None, timeout_s=300):
        assert result["grad"] <= 1e-6 and result["load_balancing_loss"] <= 1e-6, result
        assert result["reduce_groups"] in (["static"], ["None", "static"]), result
