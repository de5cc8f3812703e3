"""Destroyed gloo groups that megatron's caches still hold are freed by release_destroyed_groups."""

from __future__ import annotations

import json
import subprocess
import sys

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

# the same run ending without a call: release_at_exit (as megatron_hcp's group set-up registers
# it) runs before a counter registered earlier (atexit runs last-registered first)
AT_EXIT = SCRIPT.split("before = threads()")[0].replace(
    "from megatron_hcp.group_release import release_destroyed_groups",
    "from megatron_hcp.group_release import release_at_exit") + """
import atexit
atexit.register(lambda: print(json.dumps({"alone": alone, "at_exit": threads()}), flush=True))
release_at_exit()
release_at_exit()  # once is enough; twice changes nothing
"""


def test_release_frees_groups_megatron_caches_hold():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    counts = json.loads(out.strip().splitlines()[-1])
    # the cached module kept the subgroup's gloo threads alive through destroy and gc ...
    assert counts["before"] > counts["alone"], counts
    assert counts["emptied"] >= 1, counts
    # ... and releasing leaves the threads of the process before gloo, before interpreter teardown
    assert counts["after"] == counts["alone"], counts


def test_release_at_exit_frees_them_before_teardown():
    out = subprocess.run([sys.executable, "-c", AT_EXIT], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["at_exit"] == counts["alone"], counts


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
