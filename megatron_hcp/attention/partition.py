"""The token layout (``cp_partition_mode``) a micro-batch's attention runs in."""

from __future__ import annotations

from typing import Any

from ..sharding import DEFAULT_CP_PARTITION_MODE, ShardingError, check_partition_mode

__all__ = ["partition_mode"]


def partition_mode(config: Any, packed_seq_params: Any = None) -> str:
    """The token layout of this micro-batch: ``packed_seq_params.cp_partition_mode`` (upstream
    megatron's field, where the installed release has it) or the model config's
    ``cp_partition_mode`` (Bridge's model providers carry it), ``"zigzag"`` when neither says;
    the two disagreeing is an error, never a silent choice."""
    configured = getattr(config, "cp_partition_mode", None)
    carried = getattr(packed_seq_params, "cp_partition_mode", None)
    if configured is not None and carried is not None and configured != carried:
        raise ShardingError(
            f"packed_seq_params.cp_partition_mode={carried!r} but the model config's "
            f"cp_partition_mode={configured!r}: the batch was cut in another layout than the "
            "model attends in; shard the batch with the config's cp_partition_mode")
    return check_partition_mode(carried or configured or DEFAULT_CP_PARTITION_MODE)
