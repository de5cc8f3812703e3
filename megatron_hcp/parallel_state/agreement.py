"""Ranks agree on their configuration before any process group is created.

Ranks given different configurations would otherwise build different groups and wait in
different collectives until torch.distributed's timeout (30 minutes by default), then fail with
a store timeout that never mentions the configuration. :func:`agree` runs on the store of the
default process group (it exists as soon as ``init_process_group`` returned, before megatron
creates anything): every rank publishes its fields under one key, waits a bounded time for the
keys of all ranks and reads them. Every rank then holds the same table, so every rank raises
the same error:

* :class:`ConfigDisagreementError` names each differing field, its values and the ranks that
  hold them;
* :class:`MissingRanksError` names the ranks that did not arrive within ``timeout``.

Calls are matched by ``tag`` and a per-process call count, like collectives: every rank must
make the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "AgreementError", "ConfigDisagreementError", "MissingRanksError",
           "agree", "agree_on_config"]

DEFAULT_TIMEOUT = timedelta(seconds=120)
_calls: dict[tuple[int, str], int] = {}  # (rank, tag): rank threads of one process count apart


class AgreementError(RuntimeError):
    """Ranks did not agree before creating process groups (raised the same on every rank)."""


class ConfigDisagreementError(AgreementError):
    """Ranks passed different configurations."""


class MissingRanksError(AgreementError):
    """Some ranks never reached the agreement within the timeout."""


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) < 8 else (
        f"{', '.join(str(r) for r in ranks[:6])}, ... ({len(ranks)} ranks)")


def _differences(tables: dict[int, dict[str, Any]]) -> list[str]:
    lines = []
    for name in sorted(set().union(*tables.values())):
        holders: dict[str, list[int]] = {}
        for rank, table in sorted(tables.items()):
            value = json.dumps(table.get(name, "<missing>"), sort_keys=True)
            holders.setdefault(value, []).append(rank)
        if len(holders) > 1:
            parts = [f"{value} on rank(s) {_ranges(ranks)}" for value, ranks in
                     sorted(holders.items(), key=lambda kv: kv[1][0])]
            lines.append(f"{name}: " + "; ".join(parts))
    return lines


def agree(fields: Mapping[str, Any], *, what: str, tag: str,
          timeout: timedelta | None = None, store: Any = None) -> str:
    """Check that every rank of the default group passed the same ``fields``; their digest.

    ``fields`` must be JSON-serializable (anything else is compared by ``repr``). ``what``
    names the configuration in errors; ``tag`` separates independent agreements. Raises
    :class:`ConfigDisagreementError` or :class:`MissingRanksError` on every rank that took
    part; uses no process group, only the default group's store.
    """
    payload = json.dumps(dict(fields), sort_keys=True, default=repr)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:16]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return digest  # one process cannot disagree (and cannot create groups either)
    timeout = timeout or DEFAULT_TIMEOUT
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    count = _calls[rank, tag] = _calls.get((rank, tag), 0) + 1
    prefix = f"megatron_hcp/agree/{tag}/{count}"
    store.set(f"{prefix}/{rank}", payload)
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
    except (RuntimeError, TimeoutError):  # DistStoreError is a RuntimeError
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if missing:
            store.set(f"{prefix}/abandoned", json.dumps(missing))  # for ranks arriving late
            raise MissingRanksError(
                f"rank(s) {_ranges(missing)} of {world} did not reach the {what} agreement "
                f"({tag!r}) within {timeout.total_seconds():g} s; no process group was "
                "created. They crashed, hang, or run different code: check their logs and "
                "start every rank with the same program and configuration") from None
    if store.check([f"{prefix}/abandoned"]):
        late = json.loads(store.get(f"{prefix}/abandoned"))
        raise MissingRanksError(
            f"rank {rank} reached the {what} agreement ({tag!r}) after the other ranks gave up "
            f"waiting for rank(s) {_ranges(late)}; no process group was created. Start every "
            "rank at the same point, or raise agreement_timeout")
    tables = {r: json.loads(store.get(keys[r])) for r in range(world)}
    differing = sorted(r for r in range(world) if tables[r] != tables[0])
    if differing:
        detail = "\n".join(f"  - {line}" for line in _differences(tables))
        raise ConfigDisagreementError(
            f"ranks disagree on the {what} before any process group was created: rank(s) "
            f"{_ranges(differing)} differ from rank 0 in\n{detail}\n"
            "Fix: pass the same configuration on every rank.")
    return digest


def agree_on_config(config: Any, *, tag: str, timeout: timedelta | None = None,
                    **layout: Any) -> str:
    """:func:`agree` on a dataclass configuration (e.g. ``CPConfig``) plus layout values such
    as the world size and the rank order; values that are not plain data are compared by
    type name (process-group options and the like differ by address, not by meaning)."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    fields["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    for name, value in layout.items():
        if isinstance(value, timedelta):
            value = value.total_seconds()
        fields[name] = value if isinstance(value, (str, int, float, bool, type(None), list,
                                                   tuple)) else type(value).__name__
    return agree(fields, what=f"{type(config).__name__} and layout", tag=tag, timeout=timeout)
