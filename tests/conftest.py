"""Shared fixtures: one reusable gloo world per test module (see
megatron_hcp.harness.local_world), and the two kinds of test: ``multirank`` (a module's
``pytestmark``: it starts ranks or processes) and ``pure`` (every other test, checked: it starts
none)."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from megatron_hcp.harness.local_world import LocalWorld
from megatron_hcp.harness.threaded_world import ThreadedWorld


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that is neither ``multirank`` nor ``gpu`` is ``pure``."""
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("multirank", "gpu")):
            item.add_marker(pytest.mark.pure)


@pytest.fixture(autouse=True)
def _pure_tests_start_no_rank(request, monkeypatch):
    """A ``pure`` test that starts a Python process, a gloo world or rank threads fails, naming
    the marker to set: the markers say what a test does."""
    if request.node.get_closest_marker("pure") is None:
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is marked pure but starts ranks or a "
                             "Python process: mark it (or its module) pytest.mark.multirank")

    popen = subprocess.Popen.__init__

    def python_refused(self, args, *rest, **kwargs):
        """Python processes (ranks, launchers, CLI runs) are refused; tools such as the ``git``
        that megatron-core's import asks for its version are not ranks."""
        first = args if isinstance(args, (str, bytes)) else (list(args) or [""])[0]
        if any(word in str(first) for word in ("python", "torchrun", sys.executable)):
            refuse()
        popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", python_refused)
    monkeypatch.setattr(LocalWorld, "run", refuse)
    monkeypatch.setattr(ThreadedWorld, "__init__", refuse)
    yield


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
