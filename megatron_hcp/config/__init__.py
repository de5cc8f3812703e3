"""One validated description of a context-parallel (CP) setup, and the one value parser.

Vocabulary used throughout the project:

* **CP size** - ranks that split one sequence (``context_parallel_size``).
* **a2a level / p2p level** - the two levels of hierarchical CP (``cp_comm_type="a2a+p2p"``):
  ``hierarchical_context_parallel_sizes = [a2a, p2p]``; level 0 (a2a) is the inner, contiguous
  group, level 1 (p2p) the outer, strided ring.
* **local heads** - attention heads per tensor-parallel rank.
* **dynamic group** - with dynamic CP, the per-micro-batch CP group carved out of DPxCP.

:class:`CPConfig` uses megatron's field names; :meth:`CPConfig.validate` checks every rule at once
and raises one :class:`CPConfigError` listing each violated rule with its parameter, value, rule
and fix. Validation is pure (no collectives), so every rank raises the same error before any
process group exists.

Modules, each importing only those above it in this list (and nothing else of the project):

* :mod:`.errors` - :class:`Violation` and :class:`CPConfigError`, the error of every input check;
* :mod:`.values` - the strict value parser (:func:`parse_value`, :func:`parse_int`, ...), the
  bounds of every count (:data:`LIMITS`, :data:`MAX_RANKS`, ...), :data:`FIELD_KINDS` and
  :func:`argument_type` for argparse;
* :mod:`.flags` - megatron's command-line flags (and ``key=value``) read into field values;
* :mod:`.topology` - :class:`Topology`, every fact derived from a setup and a world size (rank
  lists, HCP levels, dynamic blocks, megatron's grids), and the one level rule
  (:func:`dynamic_levels`);
* :mod:`.rules` - :class:`CPConfig`, its validation and :meth:`CPConfig.resolve`.
"""

from .errors import CPConfigError, Violation
from .flags import check_pairs, read_flags
from .rules import (
    CP_COMM_TYPES,
    CP_PARTITION_MODES,
    DEFAULT_CP_COMM_TYPE,
    MIN_TE_VERSION_A2A_P2P,
    MIN_TE_VERSION_A2A_P2P_THD,
    SOFTMAX_TYPES,
    Backend,
    CPConfig,
    Topology,
    comm_type_or_default,
    describe_levels,
    dynamic_levels,
    is_power_of_two,
)
from .values import (
    FIELD_KINDS,
    FIELDS,
    LIMITS,
    MAX_INT,
    MAX_RANKS,
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    MAX_STEPS,
    argument_type,
    fields_read_by,
    parse_bool,
    parse_float,
    parse_int,
    parse_value,
    parse_version,
    version_tuple,
)

__all__ = [
    "CP_COMM_TYPES",
    "CP_PARTITION_MODES",
    "CPConfig",
    "DEFAULT_CP_COMM_TYPE",
    "CPConfigError",
    "FIELDS",
    "FIELD_KINDS",
    "LIMITS",
    "MAX_INT",
    "MAX_RANKS",
    "MAX_SEQUENCES",
    "MAX_SEQ_LENGTH",
    "MAX_STEPS",
    "MIN_TE_VERSION_A2A_P2P",
    "MIN_TE_VERSION_A2A_P2P_THD",
    "SOFTMAX_TYPES",
    "Backend",
    "Topology",
    "Violation",
    "argument_type",
    "check_pairs",
    "fields_read_by",
    "comm_type_or_default",
    "describe_levels",
    "dynamic_levels",
    "is_power_of_two",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_value",
    "parse_version",
    "read_flags",
    "version_tuple",
]
