"""The one-GPU suite's check of CP ranks as threads (tests/gpu: megatron's GPTModel with RoPE, the
reference CP attention, megatron's loss, DDP and optimizer; CP=4 p2p / a2a / hierarchical 2x2
against CP=1 over the same threads), run here on CPU threads: the same code, so the GPU check
can only fail on what the GPU changes."""

from __future__ import annotations

import pytest

from tests.gpu.test_one_gpu_training import THREAD_LAYOUTS, cp_threads_against_cp1

pytestmark = pytest.mark.multirank  # starts ranks or processes (tests/conftest.py)

RTOL = 1e-5  # fp32 on the CPU, as the gloo recipes' CP=1 invariance


def test_megatron_gpt_with_cp_ranks_as_threads_equals_cp1():
    deviation = cp_threads_against_cp1("cpu")
    assert set(deviation) == set(THREAD_LAYOUTS)
    assert all(dev <= RTOL for dev in deviation.values()), deviation
