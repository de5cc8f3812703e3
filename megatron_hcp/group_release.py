"""Let destroyed process groups really go before the interpreter shuts down.

``dist.destroy_process_group`` forgets a group, but a gloo group's threads and sockets live
until the last reference to its object goes. megatron-core keeps such references in
class-level ``functools.lru_cache`` wrappers (``RotaryEmbedding.forward`` caches ``self``, the
module holds its ``cp_group``), so groups outlive the run, pile up in pooled workers, and are
torn down during interpreter finalization, where gloo occasionally aborts the process
("terminate called without an active exception") after a run that succeeded.
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
import types
from collections.abc import Iterator

CACHE_OWNERS = ("megatron.",)

#: the torch.distributed backend of rank threads (:mod:`megatron_hcp.harness.threaded_world`):
#: their groups hold nothing native and go with their world (torch's threaded registry cannot
#: destroy one alone), so whoever destroys groups leaves theirs alone
THREADED_BACKEND = "mhcp_threaded"


#: where a function patched by :mod:`megatron_hcp.patching` keeps the one it replaced; followed
#: here, so that a patch never hides an upstream cache from the release
PATCHED_ORIGINAL = "__megatron_hcp_original__"


def _caches_of(namespace: dict) -> Iterator[functools._lru_cache_wrapper]:
    # type() only: some namespace values are deprecation proxies (megatron modules import
    # torch.distributed's reduce_op) that warn on any attribute access
    for value in list(namespace.values()):
        while value is not None:
            if type(value) in (staticmethod, classmethod):
                value = value.__func__
            if type(value) is functools._lru_cache_wrapper:
                yield value
            elif type(value) is not types.FunctionType:
                break
            value = vars(value).get(PATCHED_ORIGINAL)  # a patch's: what it replaced


def megatron_caches() -> list[functools._lru_cache_wrapper]:
    """The ``lru_cache`` wrappers defined at module or class level by imported megatron
    modules (megatron-core, Megatron-Bridge)."""
    found: dict[int, functools._lru_cache_wrapper] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(CACHE_OWNERS):
            continue
        namespace = getattr(module, "__dict__", {})
        for cache in _caches_of(namespace):
            found[id(cache)] = cache
        for value in list(namespace.values()):
            if issubclass(type(value), type) and vars(value).get("__module__") == name:
                for cache in _caches_of(vars(value)):
                    found[id(cache)] = cache
    return list(found.values())


def release_destroyed_groups(collect: bool = True) -> int:
    """Empty megatron's caches (they are recomputed on demand) and, with ``collect``, collect
    garbage, so groups that were destroyed are freed now. Returns the number of caches
    emptied. Call it after ``destroy_process_group`` (or megatron's
    ``destroy_model_parallel``), on every rank."""
    caches = megatron_caches()
    for cache in caches:
        cache.cache_clear()
    if collect:
        gc.collect()
    return len(caches)


def release_at_exit() -> None:
    """Have :func:`release_destroyed_groups` run once when the interpreter exits (before its
    teardown), however the program ends; registering again changes nothing. Groups still in
    use are not touched: only what nothing but megatron's caches holds is freed."""
    atexit.unregister(release_destroyed_groups)
    atexit.register(release_destroyed_groups)
