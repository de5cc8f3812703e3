"""Shared fixtures: one reusable gloo world per test module (see megatron_hcp.local_world)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

from megatron_hcp.local_world import LocalWorld


@contextlib.contextmanager
def local_world(world_size: int, env: dict[str, str] | None = None) -> Iterator[LocalWorld]:
    """Start ``world_size`` ranks once; modules wrap this in a module-scoped fixture."""
    world = LocalWorld(world_size, env=env).start()
    try:
        yield world
    finally:
        world.close()


@pytest.fixture(scope="module")
def world(request):
    """One reusable world of ``WORLD`` ranks (the test module's constant) per test module."""
    with local_world(request.module.WORLD) as w:
        yield w


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A copy of the installed megatron package (the diffs' target), once per module."""
    from megatron_hcp.patching.forkpatch import megatron_package_dir

    root = tmp_path_factory.mktemp("megatron-copy")
    shutil.copytree(megatron_package_dir(), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root
