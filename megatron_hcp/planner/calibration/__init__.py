"""The layout planner held against published measurements (``published.yaml``).

:mod:`.data` loads and checks the runs and converts published TFLOP/s to tokens/s per GPU;
:mod:`.compare` projects each run (its published layout, and the planner's own ranking) and
summarizes the error; :mod:`.fit` fits the efficiency constants of
:mod:`megatron_hcp.planner.gpus` on the runs marked ``fit: true``.
``benchmarks/plan_calibration.py`` prints the full comparison; ``megatron-hcp plan`` prints
the summary line.
"""

from .compare import (
    Comparison,
    PairGain,
    Summary,
    compare_all,
    compare_run,
    pair_gains,
    summarize,
)
from .data import DEFAULT_PATH, PublishedRun, flops_per_token, load_published

__all__ = ["DEFAULT_PATH", "Comparison", "PairGain", "PublishedRun", "Summary", "compare_all",
           "compare_run", "flops_per_token", "load_published", "pair_gains", "summarize"]
