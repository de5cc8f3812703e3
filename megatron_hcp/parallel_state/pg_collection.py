"""The ProcessGroupCollection megatron-hcp returns: megatron's, with typed attributes of its own.

:class:`HCPProcessGroupCollection` is megatron-core's ``ProcessGroupCollection`` (every field as
the installed release declares it, ``hcp`` included) plus two attributes that are not dataclass
fields - megatron and Megatron-Bridge iterate ``dataclasses.fields`` of a collection and expect
process groups there (Bridge's ``is_rank_in_pg``):

* ``dynamic_cp``: this rank's :class:`~.dynamic.DynamicCPGroups` (None without dynamic CP);
* ``topology``: the :class:`~megatron_hcp.config.Topology` the groups were built from (None when
  megatron's MPU path built them).

Imports megatron-core: import this module lazily, where a collection is built.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from megatron.core.process_groups_config import ProcessGroupCollection

from ..config import Topology
from .dynamic import DynamicCPGroups

__all__ = ["HCPProcessGroupCollection", "attach_dynamic_cp_groups"]


class HCPProcessGroupCollection(ProcessGroupCollection):
    """megatron's ``ProcessGroupCollection`` with megatron-hcp's ``dynamic_cp`` and ``topology``
    (typed attributes, not dataclass fields; see the module docstring)."""

    dynamic_cp: DynamicCPGroups | None = None
    topology: Topology | None = None

    @classmethod
    def of(cls, collection: Any, *, dynamic_cp: DynamicCPGroups | None = None,
           topology: Topology | None = None) -> HCPProcessGroupCollection:
        """``collection``'s groups (every declared field it has set) in a new collection of this
        type, with ``dynamic_cp`` and ``topology``."""
        declared = {f.name for f in fields(ProcessGroupCollection)}
        out = cls(**{k: v for k, v in vars(collection).items() if k in declared})
        out.dynamic_cp, out.topology = dynamic_cp, topology
        return out

    def __repr__(self) -> str:
        dynamic = ("" if self.dynamic_cp is None
                   else f", dynamic_cp(sizes {sorted(self.dynamic_cp.by_size)})")
        return f"HCP{super().__repr__()}{dynamic}"


def attach_dynamic_cp_groups(pg_collection: Any, groups: DynamicCPGroups | None) -> None:
    """Set (or, with None, clear) the ``dynamic_cp`` groups of an
    :class:`HCPProcessGroupCollection`; megatron's own collection has no such
    field, so it is refused (wrap it: ``HCPProcessGroupCollection.of(collection,
    dynamic_cp=groups)``)."""
    if not isinstance(pg_collection, HCPProcessGroupCollection):
        raise TypeError(
            f"pg_collection is a {type(pg_collection).__name__}, which has no dynamic_cp field; "
            "use megatron_hcp.parallel_state.pg_collection.HCPProcessGroupCollection.of("
            "collection, dynamic_cp=groups) (what create_pg_collection returns)")
    pg_collection.dynamic_cp = groups
