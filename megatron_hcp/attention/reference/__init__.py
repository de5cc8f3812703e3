"""Pure-PyTorch context-parallel attention: p2p, all_gather, a2a, a2a+p2p; bshd, sbhd, thd."""

from ...sharding import (  # re-exported: the attention API's callers shard with these
    assemble_from_chunks,
    gather_from_cp,
    get_local_chunk,
    pad_thd,
    thd_partition_indices,
)
from .api import context_parallel_attention, local_attention
from .block_counter import BlockCounter
from .comm import CommCounter, CommRecord
from .oracle import full_attention
from .repartition import convert_partition
from .seq_layout import CPAttentionError

__all__ = [
    "BlockCounter",
    "CPAttentionError",
    "CommCounter",
    "CommRecord",
    "assemble_from_chunks",
    "context_parallel_attention",
    "convert_partition",
    "full_attention",
    "gather_from_cp",
    "local_attention",
    "get_local_chunk",
    "pad_thd",
    "thd_partition_indices",
]
