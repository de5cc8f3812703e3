"""Real 2-rank gloo runs: a checkpoint iteration is complete only with its manifest (written
last, sizes and sha256); resuming verifies it and names the bad file on every rank."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.training.checkpoint import MANIFEST, iteration_dir

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

WORLD = 2
STEP = 3


def save(directory: str) -> None:
    from megatron_hcp.training.checkpoint import save_checkpoint

    rank = dist.get_rank()
    save_checkpoint(directory, STEP, {"w": torch.full((64,), float(rank)), "rank": rank})


def load(directory: str):
    from megatron_hcp.training.checkpoint import load_checkpoint

    try:
        state = load_checkpoint(directory, STEP)
    except Exception as err:  # the test compares what every rank raised
        return type(err).__name__, str(err)
    return "ok", (state["rank"], float(state["w"][0]))


@pytest.fixture
def saved(world, tmp_path):
    world.run(save, str(tmp_path))
    return iteration_dir(tmp_path, STEP)


def test_manifest_lists_every_file_with_size_and_sha256(world, saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["step"] == STEP and manifest["world_size"] == WORLD
    assert [e["file"] for e in manifest["files"]] == ["rank_0.pt", "rank_1.pt"]
    assert manifest["files"][1]["bytes"] == (saved / "rank_1.pt").stat().st_size
    assert sorted(p.name for p in saved.iterdir()) == [MANIFEST, "rank_0.pt", "rank_1.pt"]
    assert world.run(load, str(saved.parent)) == [("ok", (0, 0.0)), ("ok", (1, 1.0))]


def _same_error(results) -> str:
    assert {r[0] for r in results} == {"CheckpointError"}, results
    assert results[0] == results[1]
    return results[0][1]


def test_a_flipped_bit_is_named_on_every_rank(world, saved):
    path = saved / "rank_1.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    message = _same_error(world.run(load, str(saved.parent)))
    assert "rank 1:" in message and "rank_1.pt does not match its sha256" in message
    assert "rank 0:" not in message


def test_a_truncated_file_is_named(world, saved):
    path = saved / "rank_0.pt"
    path.write_bytes(path.read_bytes()[:100])
    assert "rank_0.pt has 100 bytes" in _same_error(world.run(load, str(saved.parent)))


def test_an_iteration_without_manifest_is_incomplete(world, saved):
    (saved / MANIFEST).unlink()
    assert "is incomplete" in _same_error(world.run(load, str(saved.parent)))


def _regenerate_manifest(folder) -> None:
    """What a user or tool regenerating the manifest after replacing a file would write."""
    import hashlib

    manifest = json.loads((folder / MANIFEST).read_text())
    for entry in manifest["files"]:
        data = (folder / entry["file"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_entry_without_sha256_is_named_on_every_rank(world, saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    del manifest["files"][1]["sha256"]
    (saved / MANIFEST).write_text(json.dumps(manifest))
    message = _same_error(world.run(load, str(saved.parent)))
    assert "entry for rank_1.pt has no sha256" in message, message


@pytest.mark.parametrize("how", ["rank file", "iteration", "manifest path"])
def test_links_and_paths_that_leave_the_checkpoint_are_refused(world, saved, tmp_path_factory,
                                                               how):
    outside = tmp_path_factory.mktemp("elsewhere")
    if how == "rank file":  # an identical copy outside, linked in: digest and size match
        (outside / "rank_1.pt").write_bytes((saved / "rank_1.pt").read_bytes())
        (saved / "rank_1.pt").unlink()
        (saved / "rank_1.pt").symlink_to(outside / "rank_1.pt")
        expected = "rank_1.pt is a link or not a regular file inside the checkpoint"
    elif how == "iteration":
        copy = outside / saved.name
        saved.rename(copy)
        saved.symlink_to(copy)
        expected = "is a link or leaves the checkpoint directory"
    else:
        manifest = json.loads((saved / MANIFEST).read_text())
        manifest["files"][0]["file"] = "../rank_0.pt"
        (saved / MANIFEST).write_text(json.dumps(manifest))
        expected = "names '../rank_0.pt', not a rank file"
    message = _same_error(world.run(load, str(saved.parent)))
    assert expected in message, message


@pytest.mark.parametrize("replacement", ["garbage", "the other rank's file"])
def test_one_ranks_replaced_file_is_the_same_error_on_every_rank(world, saved, replacement):
    """The manifest is regenerated, so the digest matches: the ranks still agree, after
    unpickling, instead of one rank raising UnpicklingError / IndexError alone."""
    data = (b"\x80\x04not a checkpoint" * 40 if replacement == "garbage"
            else (saved / "rank_0.pt").read_bytes())
    (saved / "rank_1.pt").write_bytes(data)
    _regenerate_manifest(saved)
    message = _same_error(world.run(load, str(saved.parent)))
    assert "rank 1:" in message and "rank 0:" not in message, message
    assert ("cannot be loaded" if replacement == "garbage"
            else "holds rank 0 of 2 at step 3, not rank 1 of 2") in message, message


def test_a_deeply_nested_manifest_is_a_named_error(world, saved):
    (saved / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    message = _same_error(world.run(load, str(saved.parent)))
    assert "unreadable (nests lists or objects deeper than the limit of 64" in message


def load_and_fail_on_rank_1(directory: str):
    from megatron_hcp.training.checkpoint import load_checkpoint

    def restore(state):
        if state["rank"] == 1:
            raise IndexError("index 3 is out of bounds for dimension 0 with size 2")

    try:
        load_checkpoint(directory, STEP, restore=restore)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    return "ok", None


def test_a_restore_failing_on_one_rank_fails_on_every_rank(world, saved):
    message = _same_error(world.run(load_and_fail_on_rank_1, str(saved.parent)))
    assert "rank 1:" in message and "IndexError: index 3 is out of bounds" in message
