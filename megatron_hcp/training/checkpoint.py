"""Per-rank checkpoints that cannot be half-written, silently corrupted or read from elsewhere.

``<dir>/iter_<step>/rank_<r>.pt`` per rank, written atomically
(:func:`~megatron_hcp.files.atomic_write.write_atomic`) and holding this rank's state with its rank,
world size and step. When every rank has written its file, rank 0 writes ``manifest.json`` last
(files, sizes, sha256; same atomic write): an iteration without a manifest is incomplete.

:func:`load_checkpoint` has the ranks agree twice, so that a problem on any one rank raises the
same :class:`CheckpointError`, naming the rank and the file, on every rank:

1. before unpickling: the manifest is read with the bounded reader and checked (every entry
   with its file name, size and sha256); the iteration, the manifest and this rank's file must
   be regular files inside the checkpoint directory (no symlink or path leaving it); the file is
   read into memory and its sha256 compared with the manifest's, and only those bytes are
   unpickled (``weights_only=True``);
2. after unpickling: the file must be this rank's (rank, world size, step), and the caller's
   ``restore`` (e.g. ``load_state_dict``) must succeed; a file replaced by another rank's or a
   model's of another shape (with the manifest regenerated to match) is named like a flipped bit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..files.atomic_write import write_atomic
from ..files.bounded_read import InputFileError, read_json

__all__ = ["MANIFEST", "CheckpointError", "iteration_dir", "load_checkpoint", "save_checkpoint"]

MANIFEST = "manifest.json"
_RANK_FILE = re.compile(r"rank_(\d+)\.pt")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or does not fit this run."""


def iteration_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"iter_{step:07d}"


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any],
                    group: Any = None) -> Path:
    """Write this rank's ``state``; rank 0 of ``group`` (default: the world) then writes the
    manifest. Collective over ``group``; returns the iteration directory."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    folder = iteration_dir(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}.pt"
    buffer = io.BytesIO()
    torch.save({"rank": rank, "world_size": world, "step": step, "state": state}, buffer)
    data = buffer.getvalue()
    write_atomic(path, data)
    entry = {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, entry, group=group)
    if rank == 0:
        manifest = {"step": step, "world_size": world, "files": entries}
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    dist.barrier(group=group)
    return folder


def _inside(path: Path, root: Path) -> bool:
    """``path`` is a regular file or directory under ``root`` with no symlink on the way."""
    if path.is_symlink():
        return False
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _manifest_entries(folder: Path, step: int, world: int) -> dict[str, dict] | str:
    """The manifest's entries by file name, or what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists() and not manifest_path.is_symlink():
        return (f"{manifest_path} is missing: the checkpoint of step {step} is incomplete (a "
                "save did not finish); resume from an earlier step")
    if not _inside(manifest_path, folder) or not manifest_path.is_file():
        return f"{manifest_path} is a link or not a regular file inside the checkpoint"
    try:
        manifest = read_json(manifest_path, "checkpoint manifest", max_bytes=1 << 24)
    except InputFileError as err:
        return f"{manifest_path} is unreadable ({err.rule}); resume from an earlier step"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return f"{manifest_path} has no list of files; resume from an earlier step"
    if manifest.get("step") != step or manifest.get("world_size") != world:
        return (f"{manifest_path} describes step {manifest.get('step')} on "
                f"{manifest.get('world_size')} ranks, this run resumes step {step} on {world}; "
                "use the same world size")
    entries: dict[str, dict] = {}
    for i, entry in enumerate(manifest["files"]):
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _RANK_FILE.fullmatch(name):
            return (f"{manifest_path} entry {i} names {name!r}, not a rank file rank_<r>.pt of "
                    "this directory")
        for key, ok in (("bytes", lambda v: isinstance(v, int) and not isinstance(v, bool)
                         and v >= 0),
                        ("sha256", lambda v: isinstance(v, str) and _SHA256.fullmatch(v))):
            if key not in entry:
                return f"{manifest_path} entry for {name} has no {key}; it cannot be verified"
            if not ok(entry[key]):
                return f"{manifest_path} entry for {name} has a malformed {key}"
        entries[name] = entry
    return entries


def _verified_bytes(directory: Path, step: int, rank: int, world: int) -> tuple[bytes, str | None]:
    """This rank's file, read once and checked against the manifest (nothing unpickled)."""
    folder = iteration_dir(directory, step)
    if folder.exists() and not _inside(folder, directory):
        return b"", f"{folder} is a link or leaves the checkpoint directory {directory}"
    entries = _manifest_entries(folder, step, world)
    if isinstance(entries, str):
        return b"", entries
    path = folder / f"rank_{rank}.pt"
    entry = entries.get(path.name)
    if entry is None:
        return b"", f"{folder / MANIFEST} lists no {path.name}"
    if not path.exists() and not path.is_symlink():
        return b"", f"{path} is missing"
    if not _inside(path, folder) or not path.is_file():
        return b"", (f"{path} is a link or not a regular file inside the checkpoint "
                     "directory; copy the real file there")
    size = path.stat().st_size
    if size != entry["bytes"]:
        return b"", f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
    with open(path, "rb") as fh:
        data = fh.read(size + 1)
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        return b"", f"{path} does not match its sha256 in the manifest (corrupted)"
    return data, None


def _agree(problem: str | None, group: Any, what: str) -> None:
    """Every rank raises the same CheckpointError when any rank found a problem."""
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, problem, group=group)  # this job's own ranks
    problems = [f"rank {r}: {p}" for r, p in enumerate(found) if p]
    if problems:
        raise CheckpointError(f"cannot resume from a checkpoint that {what}:\n"
                              + "\n".join(f"  - {p}" for p in problems))


def load_checkpoint(directory: str | os.PathLike, step: int, group: Any = None,
                    restore: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """This rank's state of ``step`` (collective over ``group``; module docstring): verified
    against the manifest before unpickling, then checked to be this rank's, then passed to
    ``restore``; a problem on any rank raises the same :class:`CheckpointError` everywhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root = Path(directory)
    data, problem = _verified_bytes(root, step, rank, world)
    _agree(problem, group, "fails verification")
    path = iteration_dir(root, step) / f"rank_{rank}.pt"
    state: dict[str, Any] = {}
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if not isinstance(saved, dict) or not {"rank", "world_size", "step", "state"} <= set(
                saved):
            problem = f"{path} is not a checkpoint file of this project"
        elif (saved["rank"], saved["world_size"], saved["step"]) != (rank, world, step):
            problem = (f"{path} holds rank {saved['rank']} of {saved['world_size']} at step "
                       f"{saved['step']}, not rank {rank} of {world} at step {step} (files "
                       "swapped or copied?)")
        else:
            state = saved["state"]
            if restore is not None:
                restore(state)
    except Exception as err:  # noqa: BLE001 - any rank's failure becomes everyone's error
        problem = f"{path} cannot be loaded into this run ({type(err).__name__}: " + (
            " ".join(str(err).split())[:300] + ")")
    _agree(problem, group, "does not fit this run")
    return state
