"""Destroyed gloo groups that megatron's caches still hold are freed by release_destroyed_groups."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# one gloo rank; megatron's RotaryEmbedding (its forward is a class-level lru_cache that keeps
# the module, and with it the module's cp_group) used on a subgroup, then everything destroyed
SCRIPT = r"""
import gc, json, os
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_hcp.group_release import release_destroyed_groups
from megatron_hcp.patching import apply_cpu_runtime

apply_cpu_runtime()  # megatron's rotary tables on CPU

RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(16)
threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731 - native threads too
alone = threads()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.new_group([0])
rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                      cp_group=group)
rope(16)
del rope, group
dist.destroy_process_group()
gc.collect()
before = threads()
emptied = release_destroyed_groups()
print(json.dumps({"before": before, "after": threads(), "alone": alone, "emptied": emptied}))
"""

# a run on megatron-hcp's MPU path that ends without any call: the set-up registered
# release_at_exit, which runs before a counter registered earlier (atexit: last in, first out)
AT_EXIT = r"""
import atexit, gc, json, os
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_hcp.config import CPConfig
from megatron_hcp.parallel_state.mpu import destroy_model_parallel, initialize_model_parallel
from megatron_hcp.patching import apply_cpu_runtime

apply_cpu_runtime()
RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(16)
threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731 - native threads too
alone = threads()
atexit.register(lambda: print(json.dumps({"alone": alone, "at_exit": threads()}), flush=True))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
initialize_model_parallel(CPConfig(context_parallel_size=1, num_attention_heads=4,
                                   num_query_groups=2, seq_length=64),
                          create_gloo_process_groups=False)
rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                      cp_group=ps.get_context_parallel_group())
rope(16)
del rope
destroy_model_parallel()
dist.destroy_process_group()
gc.collect()
print(json.dumps({"alone": alone, "ended": threads()}), flush=True)
"""

# set-ups that register release_at_exit (atexit.register records what it is given)
RECORD = r"""
import atexit
registered = []
_register = atexit.register


def _recording(fn, *args, **kwargs):
    registered.append(getattr(fn, "__qualname__", repr(fn)))
    return _register(fn, *args, **kwargs)


atexit.register = _recording
"""
REGISTERS = {
    "collection": r"""
import torch.distributed as dist
from megatron_hcp.config import CPConfig
from megatron_hcp.parallel_state.collection import create_pg_collection
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
create_pg_collection(CPConfig(context_parallel_size=1, num_attention_heads=4,
                              num_query_groups=2, seq_length=64))
""",
    "bridge-hook": r"""
from megatron_hcp.bridge.run import prepare_environment
prepare_environment()  # the import shims Bridge needs here, then megatron_hcp.bridge.install()
""",
}
CHECK_REGISTERED = r"""
print("registered" if "release_destroyed_groups" in registered else f"not in {registered}")
"""


@pytest.mark.multirank
def test_release_frees_groups_megatron_caches_hold():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    counts = json.loads(out.strip().splitlines()[-1])
    # the cached module kept the subgroup's gloo threads alive through destroy and gc ...
    assert counts["before"] > counts["alone"], counts
    assert counts["emptied"] >= 1, counts
    # ... and releasing leaves the threads of the process before gloo, before interpreter teardown
    assert counts["after"] == counts["alone"], counts


@pytest.mark.multirank
def test_groups_of_the_mpu_path_are_freed_at_exit():
    out = subprocess.run([sys.executable, "-c", AT_EXIT], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    lines = [json.loads(line) for line in out.strip().splitlines()[-2:]]
    ended, at_exit = lines
    # megatron's cache still holds the CP group when the program ends ...
    assert ended["ended"] > ended["alone"], lines
    # ... and the registration made at set-up frees it before interpreter teardown
    assert at_exit["at_exit"] == at_exit["alone"], lines


@pytest.mark.parametrize("setup", sorted(REGISTERS))
@pytest.mark.multirank
def test_set_ups_register_release_at_exit(setup):
    if setup == "bridge-hook" and sys.version_info < (3, 12):
        pytest.skip("needs Megatron-Bridge 0.6.2, which installs on Python 3.12 only: the py312 "
                    "leg runs it (MEGATRON_HCP_STACK=py312)")
    out = subprocess.run([sys.executable, "-c", RECORD + REGISTERS[setup] + CHECK_REGISTERED],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.strip().splitlines()[-1] == "registered", out


def test_finding_the_caches_reads_no_deprecated_attribute(monkeypatch):
    """Megatron modules can hold deprecation proxies (megatron.energon, imported by Bridge,
    holds torch.distributed's reduce_op): looking for caches must not touch them, or every run
    ends with FutureWarnings."""
    import types
    import warnings

    import megatron.core.models.gpt  # noqa: F401 - a module whose cache is looked for
    import torch.distributed.distributed_c10d as c10d

    from megatron_hcp.group_release import megatron_caches

    probe = types.ModuleType("megatron.hcp_probe")
    probe.reduce_op = vars(c10d)["reduce_op"]
    monkeypatch.setitem(sys.modules, probe.__name__, probe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = {f"{c.__module__}.{c.__qualname__}" for c in megatron_caches()}
    assert "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward" \
        in names, names


def test_a_patch_never_hides_an_upstream_cache():
    """The patch rope-cp-partition-mode replaces RotaryEmbedding.forward (an lru_cache of
    upstream's) with a cached function of its own: both caches are found, so the release still
    empties upstream's (which holds the CP groups it was called with)."""
    import megatron.core.models.gpt  # noqa: F401

    from megatron_hcp.group_release import megatron_caches
    from megatron_hcp.patching import ALL_PATCHES, apply, is_applied, revert

    patch = next(p for p in ALL_PATCHES if p.name == "rope-cp-partition-mode")
    was_applied = is_applied(patch)
    if not was_applied:
        apply([patch])
    try:
        names = {f"{c.__module__}.{c.__qualname__}" for c in megatron_caches()}
    finally:
        if not was_applied:
            revert([patch])
    assert {"megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward",
            "megatron_hcp.patching.partition_layout.make_rope_table.<locals>.forward"} <= names
