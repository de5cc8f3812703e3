"""CP attention's peak per rank on a ring of four inside an all-to-all of two (a2a+p2p at
CP 8; 8 gloo ranks, CPU, fp32): the middle ring steps hold two K/V messages, which a CP 4
world's ring of two never does.
"""

from __future__ import annotations

import pytest

from megatron_hcp.attention.reference.memory_proxy import MemoryCase, rank_memory
from megatron_hcp.parallel_state.groups import bare_cp_groups

from .test_attention_memory import PEAK

pytestmark = [pytest.mark.multirank, pytest.mark.torch_only]

WORLD = 8


def test_a2a_p2p_at_256_tokens_a_rank_within_its_peak(world):
    """a2a+p2p [2, 4] at S 2048, 8 heads of 64: after the all-to-all each ring rank holds 512
    tokens of 4 heads (q 2^17 elements, as at CP 16, S 4096). bshd's ring blocks of half the
    rows and every column halve their columns (``functions.HALVE_ELEMENTS`` 2^17; measured
    1.99, before 2.07); thd's masked blocks run in row chunks whose masks stay within 2^15
    elements (``kernels.MASK_ELEMENTS``; 1.93, before 2.01)."""
    cases = tuple(MemoryCase(f"a2a+p2p {fmt}", "a2a+p2p", 8, fmt=fmt, seq=2048)
                  for fmt in ("bshd", "thd"))
    peak: dict[str, float] = {}
    for results in world.run(rank_memory, cases, cp_groups=bare_cp_groups):
        for case, (cp, flash, _) in zip(cases, results):
            peak[case.fmt] = max(peak.get(case.fmt, 0.0), cp.peak / flash.peak)
    assert max(peak.values()) <= PEAK["a2a+p2p"], peak
