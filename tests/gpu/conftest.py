"""The GPU suite's fixture: ``report`` records a check's GPUs and figure for the summary table
(junit XML properties, read by ``tests/gpu/report.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def report(record_property):
    """``report(gpus, figure)``: how many GPUs the check used and its figure (an error, a
    ratio), shown in ``./scripts/gpu_check.sh``'s table."""

    def _report(gpus: int, figure: str) -> None:
        record_property("gpus", gpus)
        record_property("figure", figure)

    return _report
