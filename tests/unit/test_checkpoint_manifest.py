"""Real 2-rank gloo runs: a checkpoint iteration is complete only with its manifest (written
last, sizes and sha256); resuming verifies it and names the bad file on every rank."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_hcp.training.checkpoint import MANIFEST, iteration_dir

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
