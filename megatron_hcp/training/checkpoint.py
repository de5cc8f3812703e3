"""Per-rank checkpoints that cannot be half-written or silently corrupted.

``<dir>/iter_<step>/rank_<r>.pt`` per rank: written to a temporary file, fsynced, renamed, the
directory fsynced. When every rank has written its file, rank 0 writes ``manifest.json`` last
(files, sizes, sha256; same temp/fsync/rename): an iteration without a manifest is incomplete.
:func:`load_checkpoint` verifies this rank's file against the manifest before ``torch.load``
(``weights_only=True``) and all ranks share what they found, so a missing manifest, a truncated
file or a flipped bit raises the same :class:`CheckpointError`, naming the file, on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MANIFEST", "CheckpointError", "iteration_dir", "load_checkpoint", "save_checkpoint"]

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not fit this run."""


def iteration_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"iter_{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any],
                    group: Any = None) -> Path:
    """Write this rank's ``state``; rank 0 of ``group`` (default: the world) then writes the
    manifest. Collective over ``group``; returns the iteration directory."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    folder = iteration_dir(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}.pt"
    _write_atomically(path, lambda fh: torch.save(state, fh))
    entry = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, entry, group=group)
    if rank == 0:
        manifest = {"step": step, "world_size": world, "files": entries}
        _write_atomically(folder / MANIFEST,
                          lambda fh: fh.write(json.dumps(manifest, indent=1).encode()))
    dist.barrier(group=group)
    return folder


def _problem(folder: Path, step: int, rank: int, world: int) -> str | None:
    """What is wrong with this rank's part of the checkpoint (None: verified)."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = {e["file"]: e for e in manifest["files"]}
        saved_step, saved_world = manifest["step"], manifest["world_size"]
    except FileNotFoundError:
        return (f"{manifest_path} is missing: the checkpoint of step {step} is incomplete (a "
                "save did not finish); resume from an earlier step")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({err}); resume from an earlier step"
    if saved_step != step or saved_world != world:
        return (f"{manifest_path} describes step {saved_step} on {saved_world} ranks, this run "
                f"resumes step {step} on {world}; use the same world size")
    path = folder / f"rank_{rank}.pt"
    entry = files.get(path.name)
    if entry is None:
        return f"{manifest_path} lists no {path.name}"
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
    if _sha256(path) != entry["sha256"]:
        return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None


def load_checkpoint(directory: str | os.PathLike, step: int, group: Any = None
                    ) -> dict[str, Any]:
    """This rank's state of ``step``, verified against the manifest first (collective over
    ``group``: every rank raises the same :class:`CheckpointError` if any rank's file is bad)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    folder = iteration_dir(directory, step)
    found: list[Any] = [None] * world
    dist.all_gather_object(found, _problem(folder, step, rank, world), group=group)
    problems = [f"rank {r}: {p}" for r, p in enumerate(found) if p]
    if problems:
        raise CheckpointError("cannot resume from a checkpoint that fails verification:\n"
                              + "\n".join(f"  - {p}" for p in problems))
    return torch.load(folder / f"rank_{rank}.pt", weights_only=True, map_location="cpu")
