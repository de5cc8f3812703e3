"""Fork-style patches: drift guard, atomic check/apply/revert, equality with the runtime form."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_hcp.local_world import LocalWorld
from megatron_hcp.patching import ALL_PATCHES, PatchError
from megatron_hcp.patching.forkpatch import (
    PATCHES_DIR,
    SERIES,
    apply_diffs,
    check_diffs,
    diff_digest,
    megatron_package_dir,
    read_header,
    revert_diffs,
    runtime_digest,
)
from tests.unit._fork_worker import WORLD, train_with

VERSIONS = sorted({v for p in ALL_PATCHES for v in p.versions})


# ---------------------------------------------------------------- drift guard
@pytest.mark.parametrize("version", VERSIONS)
def test_every_runtime_patch_has_its_diff_and_nothing_else(version):
    files = sorted((PATCHES_DIR / f"megatron-core-{version}").glob("*.patch"))
    names = [f.name.split("-", 1)[1].removesuffix(".patch") for f in files]
    assert names == list(SERIES)  # numbered in series order
    assert sorted(SERIES) == sorted(p.name for p in ALL_PATCHES if version in p.versions)


@pytest.mark.parametrize("version", VERSIONS)
def test_diffs_match_the_current_runtime_patches(version):
    """Changing a runtime patch without regenerating its diff (or editing a diff by hand)
    fails here: regenerate with `.venv/bin/python patches/generate.py` and review both."""
    table = {p.name: p for p in ALL_PATCHES}
    for file in sorted((PATCHES_DIR / f"megatron-core-{version}").glob("*.patch")):
        header = read_header(file)
        patch = table[header["Patch-Name"]]
        assert header["Runtime-Digest"] == runtime_digest(patch), (
            f"{patch.name}: runtime patch changed since {file.name} was generated")
        assert header["Diff-Digest"] == diff_digest(header["body"]), (
            f"{file.name}: diff edited by hand (digest mismatch)")
        assert header["Megatron-Core-Versions"] == ", ".join(patch.versions)
        # the diff touches the upstream file the runtime patch names
        assert f"b/{patch.upstream.split()[0].split(':')[0]}" in header["body"], file.name


# ---------------------------------------------------------------- command
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A copy of the installed megatron package (the diffs' target)."""
    root = tmp_path_factory.mktemp("megatron-copy")
    shutil.copytree(megatron_package_dir(), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted((root / "megatron").rglob("*.py"))}


def test_check_apply_revert_round_trip(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    before = snapshot(target)
    version, status = check_diffs(target / "megatron")  # installed-package form of the path
    assert version == "0.16.1" and {s.state for s in status} == {"applicable"}
    assert apply_diffs(target) == list(SERIES)
    assert {s.state for s in check_diffs(target)[1]} == {"applied"}
    assert apply_diffs(target) == []  # idempotent
    assert (target / "megatron" / "core" / "cpu_runtime.py").is_file()
    assert revert_diffs(target) == list(reversed(SERIES))
    assert snapshot(target) == before  # byte-identical original


def test_refuses_other_versions_and_conflicts_atomically(pristine, tmp_path):
    target = tmp_path / "pkg"
    shutil.copytree(pristine, target)
    info = target / "megatron" / "core" / "package_info.py"
    original = info.read_text()
    info.write_text(original.replace("MINOR = 16", "MINOR = 15"))
    with pytest.raises(PatchError, match="no fork patches for megatron-core 0.15.1"):
        apply_diffs(target)
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


# ---------------------------------------------------------------- equality of the two forms
@pytest.fixture(scope="module")
def patched_world(pristine):
    apply_diffs(pristine)
    # fresh interpreters (not the shared forkserver, which may have imported megatron already):
    # each rank imports megatron from the patched copy
    with LocalWorld(WORLD, start_method="spawn") as w:
        yield w, str(pristine)


@pytest.fixture(scope="module")
def runtime_world():
    with LocalWorld(WORLD) as w:
        yield w


@pytest.mark.parametrize("cp, comm, hcp, pp, dynamic", [
    (4, "a2a+p2p", [2, 2], 1, False), (2, "all_gather", None, 2, False), (2, "p2p", None, 2, True)])
def test_diffs_train_exactly_like_the_runtime_patches(patched_world, runtime_world, cp, comm,
                                                      hcp, pp, dynamic):
    world, source = patched_world
    forked = world.run(train_with, source, cp, comm, hcp, pp, dynamic)
    runtime = runtime_world.run(train_with, None, cp, comm, hcp, pp, dynamic)
    for f, r in zip(forked, runtime):
        assert f["where"].startswith(source) and not f["applied"]  # the diffs alone
        assert "cpu-schedules-device" in r["applied"]
        assert f["loss"] == r["loss"] and f["grad_norm"] == r["grad_norm"], (f, r)
