"""RoPE in the contiguous CP layout (patch ``rope-cp-partition-mode``).

megatron-core cuts RoPE's table for a CP rank the zigzag way only: ``RotaryEmbedding.forward``
takes chunks ``r`` and ``2cp-1-r`` of the table (bshd), and ``_apply_rotary_pos_emb_thd`` the
same chunks of every packed sequence. With ``cp_partition_mode="contiguous"`` (the model config's
field, as upstream names it) a rank holds slice ``r`` of every sequence instead, so RoPE must
rotate its tokens by the positions of that slice. Zigzag (the default) is untouched: the
patched functions call upstream's.
"""

from __future__ import annotations

import functools
from typing import Any

from ..attention.partition import partition_mode
from ..sharding import thd_partition_indices

__all__ = ["NoCPGroup", "make_apply_rope", "make_gpt_init", "make_rope_table"]


class NoCPGroup:
    """What RoPE needs of a CP group when it runs without CP: ``size()`` and ``rank()``."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def make_gpt_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        """Upstream's; RoPE's table then knows the model's CP layout."""
        original(self, config, *args, **kwargs)
        rope = getattr(self, "rotary_pos_emb", None)
        if rope is not None:
            rope.cp_partition_mode = partition_mode(config)

    return __init__


def make_rope_table(original):
    @functools.lru_cache(maxsize=32)
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Any = None):
        """Upstream's table; in the contiguous layout (not packed) this rank's slice of it."""
        group = cp_group if cp_group is not None else getattr(self, "cp_group", None)
        if (getattr(self, "cp_partition_mode", "zigzag") == "zigzag" or packed_seq
                or group is None or group.size() == 1):
            return original(self, max_seq_len, offset, packed_seq, cp_group)
        emb = self.get_emb(max_seq_len, offset)
        if emb.shape[0] % group.size():
            raise ValueError(
                f"RoPE table of {emb.shape[0]} positions cannot be cut into {group.size()} "
                "contiguous slices: the sequence length must be a multiple of the CP size")
        return emb.chunk(group.size(), dim=0)[group.rank()]

    return forward


def make_apply_rope(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             *args, **kwargs):
        """Upstream's; packed (thd) input in the contiguous layout is rotated as the whole
        packed batch would be without CP (upstream's own code, on the batch with this rank's
        slices in place) and this rank's slices are taken back."""
        if cu_seqlens is None or partition_mode(config) == "zigzag":
            return original(t, freqs, config, cu_seqlens, mscale, cp_group, *args, **kwargs)
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        if cp_group.size() == 1:
            return original(t, freqs, config, cu_seqlens, mscale, cp_group, *args, **kwargs)
        if config.apply_rope_fusion:
            raise ValueError(
                "apply_rope_fusion=True with cp_partition_mode='contiguous': Transformer "
                "Engine's fused THD RoPE cuts sequences zigzag; set apply_rope_fusion=False")
        idx = thd_partition_indices(cu_seqlens.cpu(), cp_group.size(), cp_group.rank(),
                                    cp_partition_mode="contiguous").to(t.device)
        whole = t.new_zeros((int(cu_seqlens[-1]), *t.shape[1:])).index_copy(0, idx, t)
        out = original(whole, freqs, config, cu_seqlens, mscale, NoCPGroup(), *args, **kwargs)
        return out.index_select(0, idx)

    return apply_rotary_pos_emb
