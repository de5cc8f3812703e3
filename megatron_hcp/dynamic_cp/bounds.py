"""Lower bounds on the FLOPs makespan of any dynamic-CP plan, to read efficiencies against.

Makespan = sum over micro-batches of the slowest rank's cost (:func:`.scheduler.summarize`).

* :func:`free_split_bound` = total work / N. In the FLOPs model a sequence's cost splits
  exactly over its group (``cost(L, c) = cost(L, 1) / c``) and spreading it over more ranks only
  lowers its tokens per rank, so any micro-batch may run all its sequences on all N ranks,
  perfectly balanced: this bound is *tight* (the optimum of the FLOPs model), and a plan's
  efficiency ``ideal / makespan`` is exactly its ratio to it. Reaching it costs communication
  (every sequence on N ranks); the scheduler trades up to its 1 % tolerance for fewer
  micro-batches and less splitting.
* :func:`min_group_bound`: for plans that run every sequence on its *smallest legal* group (no
  splitting beyond what the token cap forces): each sequence alone costs
  ``cost(L, 1) / c0`` on its ranks, and its micro-batch's slowest rank costs at least that,
  so ``max(total / N, max_s cost(L_s, 1) / c0_s)``. When it exceeds ``ideal / target`` the
  target is unreachable without spreading sequences further - what the scheduler's spread
  rules do.
"""

from __future__ import annotations

from collections.abc import Sequence

from .workload import GPTWorkload, min_group_size

__all__ = ["free_split_bound", "min_group_bound"]


def free_split_bound(lengths: Sequence[int], n: int, workload: GPTWorkload) -> float:
    """Total work / ``n``: the tight FLOPs-model lower bound (module docstring)."""
    return sum(workload.cost(length, 1) for length in lengths) / n


def min_group_bound(lengths: Sequence[int], n: int, cap: int, workload: GPTWorkload,
                    min_cp_size: int = 1) -> float:
    """Lower bound for plans that keep every sequence on its smallest legal group."""
    heaviest = max(workload.cost(length, 1) / min_group_size(length, cap, n, min_cp_size)
                   for length in lengths)
    return max(free_split_bound(lengths, n, workload), heaviest)
