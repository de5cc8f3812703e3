"""One gloo world of 4 ranks for every Bridge test module here that asks for ``world``: its ranks
import Megatron-Bridge once (about 20 s of a 2-core x86_64 CPU VM per world started, 2026-11-29 at
f0e98fc), instead of once per module. Each module's runs set up and tear down Bridge's state
themselves, as they do between the tests of one module. The ranks are not daemonic: megatron's
checkpoint writer (``filesystem_async``, the resharding tests) starts a process of its own."""

from __future__ import annotations

import pytest

from megatron_hcp.harness.local_world import LocalWorld

BRIDGE_WORLD = 4


@pytest.fixture(scope="session")
def bridge_world():
    with LocalWorld(BRIDGE_WORLD, daemon=False) as world:
        yield world


@pytest.fixture(scope="module")
def world(request, bridge_world):
    """The shared world, for a module whose ``WORLD`` is :data:`BRIDGE_WORLD`."""
    assert request.module.WORLD == BRIDGE_WORLD, (
        f"{request.module.__name__}: WORLD={request.module.WORLD}; the Bridge modules share a "
        f"world of {BRIDGE_WORLD} ranks (give the module a fixture of its own)")
    return bridge_world
