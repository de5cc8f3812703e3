"""The test markers tell the truth: a ``pure`` test that starts a Python process fails (the check
in tests/conftest.py), naming the marker to set."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_a_pure_test_cannot_start_a_python_process(request):
    assert request.node.get_closest_marker("pure") is not None  # set by conftest
    with pytest.raises(AssertionError, match="marked pure but starts ranks or a Python process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_pure_test_may_run_a_tool_that_is_no_rank():
    # megatron-core's import asks git for its version: a tool, not a rank
    subprocess.run(["git", "--version"], check=True, capture_output=True)


@pytest.mark.multirank
def test_a_multirank_test_may_start_one():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
